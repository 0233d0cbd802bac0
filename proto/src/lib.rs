//! The worker-supervisor registration protocol.
//!
//! The messages are defined in `peregrine/worker/v1/registration.proto` and generated at build time. On
//! the wire every message is preceded by its length as a varint ([`prost`]'s length-delimited framing).
//! This crate holds the framing as pure functions over buffers ([`encode`], [`decode_frame`]), so the
//! supervisor (tokio) and the worker (tokio-uring) share it without sharing an IO runtime.
//!
//! Invariant: a frame longer than [`MAX_FRAME_LEN`] is an error, never an allocation. The one exception
//! is a status answer, which a status client reads with [`decode_frame_limited`] and
//! [`MAX_STATUS_FRAME_LEN`]; the supervisor never accepts more than [`MAX_FRAME_LEN`].
#![forbid(unsafe_code)]

use bytes::{Buf, BytesMut};
use prost::Message;

/// Generated types of `peregrine.worker.v1`.
#[allow(missing_docs, unreachable_pub, clippy::all, reason = "generated code")]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/peregrine.worker.v1.rs"));
}

/// The ORCA out-of-band load report protocol (`xds.service.orca.v3.OpenRcaService` and
/// `xds.data.orca.v3.OrcaLoadReport`, vendored from cncf/xds), with the `orca` feature.
#[cfg(feature = "orca")]
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod xds {
    /// Data types.
    pub mod data {
        /// ORCA.
        pub mod orca {
            /// Version 3.
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/xds.data.orca.v3.rs"));
            }
        }
    }
    /// Services.
    pub mod service {
        /// ORCA.
        pub mod orca {
            /// Version 3.
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/xds.service.orca.v3.rs"));
            }
        }
    }
}

/// The largest message either side accepts, in bytes (not counting the length prefix).
pub const MAX_FRAME_LEN: usize = 64 * 1024;

/// The largest status answer a status client accepts: one row per worker, thousands of workers.
pub const MAX_STATUS_FRAME_LEN: usize = 16 * 1024 * 1024;

/// Why a frame could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The length prefix is not a valid varint.
    #[error("invalid length prefix")]
    BadLength,
    /// The announced length exceeds the limit ([`MAX_FRAME_LEN`] unless the caller chose another).
    #[error("frame of {len} bytes exceeds the limit of {limit} bytes")]
    TooLong {
        /// The announced length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The payload is not a valid protobuf message of the expected type.
    #[error("invalid message")]
    Invalid(#[source] prost::DecodeError),
}

/// Encodes `message` with its varint length prefix.
pub fn encode(message: &impl Message) -> Vec<u8> {
    message.encode_length_delimited_to_vec()
}

/// Decodes one frame of at most [`MAX_FRAME_LEN`] bytes from the front of `buf`.
///
/// Returns `Ok(None)` when `buf` does not yet hold a whole frame (read more and call again); on success
/// the frame's bytes are removed from `buf`.
pub fn decode_frame<M: Message + Default>(buf: &mut BytesMut) -> Result<Option<M>, FrameError> {
    decode_frame_limited(buf, MAX_FRAME_LEN)
}

/// Like [`decode_frame`], with a frame limit of `limit` bytes.
pub fn decode_frame_limited<M: Message + Default>(
    buf: &mut BytesMut,
    limit: usize,
) -> Result<Option<M>, FrameError> {
    let Some((len, prefix)) = read_varint(buf)? else {
        return Ok(None);
    };
    if len > limit {
        return Err(FrameError::TooLong { len, limit });
    }
    if buf.len() < prefix + len {
        return Ok(None);
    }
    buf.advance(prefix);
    let payload = buf.split_to(len);
    M::decode(payload.freeze())
        .map(Some)
        .map_err(FrameError::Invalid)
}

/// Reads a varint length prefix: `Ok(None)` if incomplete, else the value and the prefix's size.
fn read_varint(buf: &[u8]) -> Result<Option<(usize, usize)>, FrameError> {
    let mut value: u64 = 0;
    for (i, byte) in buf.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            let len = usize::try_from(value).map_err(|_| FrameError::BadLength)?;
            return Ok(Some((len, i + 1)));
        }
    }
    if buf.len() >= 10 {
        Err(FrameError::BadLength)
    } else {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{Register, WorkerMessage, worker_message};

    fn register() -> WorkerMessage {
        WorkerMessage {
            message: Some(worker_message::Message::Register(Register {
                service: "cluster".into(),
                index: 1,
                pid: 42,
                listener: None,
            })),
        }
    }

    #[test]
    fn round_trips_byte_by_byte() {
        let bytes = encode(&register());
        let mut buf = BytesMut::new();
        for (i, b) in bytes.iter().enumerate() {
            buf.extend_from_slice(&[*b]);
            let got = decode_frame::<WorkerMessage>(&mut buf).unwrap();
            if i + 1 < bytes.len() {
                assert!(got.is_none(), "decoded early at byte {i}");
            } else {
                assert_eq!(got.unwrap(), register());
                assert!(buf.is_empty());
            }
        }
    }

    #[test]
    fn rejects_oversized_frames_before_reading_them() {
        let mut buf = BytesMut::from(&[0xff, 0xff, 0xff, 0x7f][..]);
        assert!(matches!(
            decode_frame::<WorkerMessage>(&mut buf),
            Err(FrameError::TooLong { .. })
        ));
    }

    #[test]
    fn a_status_client_may_accept_larger_frames() {
        let big = WorkerMessage {
            message: Some(worker_message::Message::Register(Register {
                service: "x".repeat(MAX_FRAME_LEN),
                ..Register::default()
            })),
        };
        let mut buf = BytesMut::from(&encode(&big)[..]);
        assert!(matches!(
            decode_frame::<WorkerMessage>(&mut buf),
            Err(FrameError::TooLong {
                limit: MAX_FRAME_LEN,
                ..
            })
        ));
        let got = decode_frame_limited::<WorkerMessage>(&mut buf, MAX_STATUS_FRAME_LEN).unwrap();
        assert_eq!(got, Some(big));
    }

    #[test]
    fn rejects_garbage() {
        let mut buf = BytesMut::from(&[3u8, 0xff, 0xff, 0xff][..]);
        assert!(matches!(
            decode_frame::<WorkerMessage>(&mut buf),
            Err(FrameError::Invalid(_))
        ));
        let mut buf = BytesMut::from(&[0x80u8; 11][..]);
        assert!(matches!(
            decode_frame::<WorkerMessage>(&mut buf),
            Err(FrameError::BadLength)
        ));
    }
}
