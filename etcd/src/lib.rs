//! The etcd v3 calls a fleet makes: keys (`KV`), leases (`Lease`) and watches (`Watch`), over
//! tonic, from etcd's own `.proto` files compiled with `protox` (no system `protoc`).
//!
//! Written here rather than taken from the `etcd-client` crate because that crate's build script
//! runs the system `protoc`, which would make protoc and its include files a requirement of every
//! build of the product. What is here is small: a channel over the endpoints ([`Client::connect`],
//! with [`ConnectOptions`]), the generated clients ([`Client::kv`], [`Client::lease`],
//! [`Client::watch`]) for requests made as etcd documents them, and the two bidirectional streams
//! driven for the caller: a lease's keep-alives ([`Client::lease_keep_alive`]) and a watch
//! ([`Client::watch_prefix`]).
//!
//! Invariant: every call is one of etcd's documented gRPC methods with the message etcd defines;
//! nothing is retried or cached here (the caller decides what a failure means).

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{
    Streaming,
    transport::{Channel, Endpoint},
};

/// The TLS settings [`ConnectOptions::with_tls`] takes: the CA etcd's certificates are checked
/// against, and the client's certificate and key.
pub use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// etcd's API, as generated from its `.proto` files.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    reason = "generated from etcd's .proto files"
)]
pub mod pb {
    /// `etcdserverpb`: the KV, Lease, Watch, Cluster, Maintenance and Auth services.
    pub mod etcdserverpb {
        include!(concat!(env!("OUT_DIR"), "/etcdserverpb.rs"));
    }
    /// `mvccpb`: a key's value and a watch's events.
    pub mod mvccpb {
        include!(concat!(env!("OUT_DIR"), "/mvccpb.rs"));
    }
    /// `authpb`: users and roles.
    pub mod authpb {
        include!(concat!(env!("OUT_DIR"), "/authpb.rs"));
    }
}

use pb::etcdserverpb::{
    DeleteRangeRequest, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseRevokeRequest, PutRequest,
    RangeRequest, TxnRequest, WatchCreateRequest, WatchRequest, request_op,
    watch_request::RequestUnion,
};
pub use pb::{
    etcdserverpb::{
        LeaseKeepAliveResponse, PutResponse, RequestOp, TxnResponse, WatchResponse,
        kv_client::KvClient, lease_client::LeaseClient, watch_client::WatchClient,
    },
    mvccpb::{Event, KeyValue, event::EventType},
};

/// Why a call to etcd failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No endpoint was given.
    #[error("no etcd endpoint")]
    NoEndpoint,
    /// An endpoint is not a URL tonic can dial, or its TLS settings do not apply.
    #[error("etcd endpoint {endpoint:?}")]
    Endpoint {
        /// The endpoint.
        endpoint: String,
        /// The cause.
        #[source]
        source: tonic::transport::Error,
    },
    /// etcd answered with an error, or could not be reached (`UNAVAILABLE`).
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    /// A stream this side drives ended: etcd closed it, or the caller dropped its other half.
    #[error("the {0} stream ended")]
    StreamEnded(&'static str),
}

/// How to connect: timeouts, HTTP/2 keep-alives and TLS.
#[derive(Clone, Debug, Default)]
pub struct ConnectOptions {
    connect_timeout: Option<Duration>,
    timeout: Option<Duration>,
    keep_alive: Option<(Duration, Duration)>,
    keep_alive_while_idle: bool,
    tls: Option<ClientTlsConfig>,
}

impl ConnectOptions {
    /// No timeouts, no keep-alives, no TLS.
    pub fn new() -> ConnectOptions {
        ConnectOptions::default()
    }

    /// How long a connection may take to open.
    #[must_use]
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }

    /// How long each request may take until its answer begins (a stream then runs on).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// HTTP/2 pings every `interval`, the connection dropped when one is not answered within
    /// `timeout`.
    #[must_use]
    pub fn with_keep_alive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keep_alive = Some((interval, timeout));
        self
    }

    /// Pings also while no request is open.
    #[must_use]
    pub fn with_keep_alive_while_idle(mut self, idle: bool) -> Self {
        self.keep_alive_while_idle = idle;
        self
    }

    /// TLS, for `https://` endpoints.
    #[must_use]
    pub fn with_tls(mut self, tls: ClientTlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    fn endpoint(&self, url: &str) -> Result<Endpoint, Error> {
        let error = |source| Error::Endpoint {
            endpoint: url.to_owned(),
            source,
        };
        let mut endpoint = Endpoint::from_shared(url.to_owned()).map_err(error)?;
        if let Some(timeout) = self.connect_timeout {
            endpoint = endpoint.connect_timeout(timeout);
        }
        if let Some(timeout) = self.timeout {
            endpoint = endpoint.timeout(timeout);
        }
        if let Some((interval, timeout)) = self.keep_alive {
            endpoint = endpoint
                .http2_keep_alive_interval(interval)
                .keep_alive_timeout(timeout)
                .keep_alive_while_idle(self.keep_alive_while_idle);
        }
        if let Some(tls) = &self.tls {
            endpoint = endpoint.tls_config(tls.clone()).map_err(error)?;
        }
        Ok(endpoint)
    }
}

/// A channel to etcd's members.
#[derive(Clone, Debug)]
pub struct Client {
    channel: Channel,
}

impl Client {
    /// A channel balanced over `endpoints` (`http://` or `https://` URLs). It connects on the
    /// first request: a member out of reach shows as that request's `UNAVAILABLE`.
    pub async fn connect(
        endpoints: impl IntoIterator<Item = impl AsRef<str>>,
        options: Option<ConnectOptions>,
    ) -> Result<Client, Error> {
        let options = options.unwrap_or_default();
        let endpoints = endpoints
            .into_iter()
            .map(|url| options.endpoint(url.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        if endpoints.is_empty() {
            return Err(Error::NoEndpoint);
        }
        Ok(Client {
            channel: Channel::balance_list(endpoints.into_iter()),
        })
    }

    /// The `KV` service: `Range`, `Put`, `DeleteRange`, `Txn`, `Compact`.
    pub fn kv(&self) -> KvClient<Channel> {
        KvClient::new(self.channel.clone())
    }

    /// The `Lease` service: `LeaseGrant`, `LeaseRevoke`, `LeaseTimeToLive`, ...
    pub fn lease(&self) -> LeaseClient<Channel> {
        LeaseClient::new(self.channel.clone())
    }

    /// The `Watch` service.
    pub fn watch(&self) -> WatchClient<Channel> {
        WatchClient::new(self.channel.clone())
    }

    /// Puts `key` = `value`, under lease `lease` unless it is 0.
    pub async fn put(
        &self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: i64,
    ) -> Result<PutResponse, Error> {
        let request = PutRequest {
            key: key.into(),
            value: value.into(),
            lease,
            ..PutRequest::default()
        };
        Ok(self.kv().put(request).await?.into_inner())
    }

    /// Applies every operation of `operations` in one transaction (no condition).
    pub async fn txn(&self, operations: Vec<RequestOp>) -> Result<TxnResponse, Error> {
        let request = TxnRequest {
            success: operations,
            ..TxnRequest::default()
        };
        Ok(self.kv().txn(request).await?.into_inner())
    }

    /// Deletes every key under `prefix`; returns how many there were.
    pub async fn delete_prefix(&self, prefix: &[u8]) -> Result<i64, Error> {
        let request = DeleteRangeRequest {
            key: prefix.to_vec(),
            range_end: prefix_end(prefix),
            ..DeleteRangeRequest::default()
        };
        Ok(self.kv().delete_range(request).await?.into_inner().deleted)
    }

    /// How many keys there are under `prefix`.
    pub async fn count_prefix(&self, prefix: &[u8]) -> Result<i64, Error> {
        let request = RangeRequest {
            key: prefix.to_vec(),
            range_end: prefix_end(prefix),
            count_only: true,
            ..RangeRequest::default()
        };
        Ok(self.kv().range(request).await?.into_inner().count)
    }

    /// A new lease of `ttl_secs` seconds; its id.
    pub async fn lease_grant(&self, ttl_secs: i64) -> Result<i64, Error> {
        let request = LeaseGrantRequest {
            ttl: ttl_secs,
            id: 0,
        };
        Ok(self.lease().lease_grant(request).await?.into_inner().id)
    }

    /// Ends lease `id` now: every key under it is deleted.
    pub async fn lease_revoke(&self, id: i64) -> Result<(), Error> {
        self.lease().lease_revoke(LeaseRevokeRequest { id }).await?;
        Ok(())
    }

    /// Opens the keep-alive stream of lease `id` with a first renewal: each
    /// [`LeaseKeeper::keep_alive`] asks etcd to renew it again, and the stream answers each with
    /// the lease's TTL left (0: the lease is gone). The first is sent before the stream is awaited:
    /// etcd sends the stream's headers with its first answer, so a stream opened with nothing to
    /// answer would wait until the request timeout.
    pub async fn lease_keep_alive(
        &self,
        id: i64,
    ) -> Result<(LeaseKeeper, Streaming<LeaseKeepAliveResponse>), Error> {
        let (sender, requests) = mpsc::channel(4);
        sender
            .send(LeaseKeepAliveRequest { id })
            .await
            .map_err(|_| Error::StreamEnded("lease keep-alive"))?;
        let answers = self
            .lease()
            .lease_keep_alive(ReceiverStream::new(requests))
            .await?
            .into_inner();
        Ok((LeaseKeeper { id, sender }, answers))
    }

    /// Watches every key under `prefix` from `start_revision` on, each answer up to
    /// `decode_limit` bytes. The first answer says the watch was created; a cancelled one says
    /// why (`canceled`, `cancel_reason`). The create request is sent before the stream is awaited,
    /// for the same reason as [`Client::lease_keep_alive`]'s first renewal.
    pub async fn watch_prefix(
        &self,
        prefix: &[u8],
        start_revision: i64,
        decode_limit: usize,
    ) -> Result<(Watcher, Streaming<WatchResponse>), Error> {
        let (sender, requests) = mpsc::channel(1);
        let create = WatchRequest {
            request_union: Some(RequestUnion::CreateRequest(WatchCreateRequest {
                key: prefix.to_vec(),
                range_end: prefix_end(prefix),
                start_revision,
                ..WatchCreateRequest::default()
            })),
        };
        sender
            .send(create)
            .await
            .map_err(|_| Error::StreamEnded("watch"))?;
        let answers = self
            .watch()
            .max_decoding_message_size(decode_limit)
            .watch(ReceiverStream::new(requests))
            .await?
            .into_inner();
        Ok((Watcher { _sender: sender }, answers))
    }
}

/// The sending half of a lease's keep-alive stream.
#[derive(Debug)]
pub struct LeaseKeeper {
    id: i64,
    sender: mpsc::Sender<LeaseKeepAliveRequest>,
}

impl LeaseKeeper {
    /// Asks etcd to renew the lease; its answer comes on the stream.
    pub async fn keep_alive(&mut self) -> Result<(), Error> {
        self.sender
            .send(LeaseKeepAliveRequest { id: self.id })
            .await
            .map_err(|_| Error::StreamEnded("lease keep-alive"))
    }
}

/// Holds a watch's request stream open: dropping it ends the watch.
#[derive(Debug)]
pub struct Watcher {
    _sender: mpsc::Sender<WatchRequest>,
}

/// A transaction's put of `key` = `value`, under lease `lease` unless it is 0.
pub fn put_op(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>, lease: i64) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key: key.into(),
            value: value.into(),
            lease,
            ..PutRequest::default()
        })),
    }
}

/// A transaction's delete of `key`.
pub fn delete_op(key: impl Into<Vec<u8>>) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestDeleteRange(
            DeleteRangeRequest {
                key: key.into(),
                ..DeleteRangeRequest::default()
            },
        )),
    }
}

/// The end of the range of every key that begins with `prefix` (etcd's `range_end`): `prefix`
/// with its last byte below 0xff raised by one, the bytes after it dropped; `\0` (every key from
/// `prefix` on) when every byte is 0xff.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefixs_range_ends_after_its_last_key() {
        assert_eq!(prefix_end(b"/p/v1/"), b"/p/v10");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
        assert_eq!(prefix_end(b""), b"\0");
    }

    #[test]
    fn an_endpoint_that_is_not_a_url_is_named() {
        let error = ConnectOptions::new().endpoint("not a url").unwrap_err();
        assert!(error.to_string().contains("\"not a url\""), "{error}");
    }
}
