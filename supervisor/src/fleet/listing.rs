//! The fleet's range read from etcd in pages, as one snapshot, whatever its size.
//!
//! etcd answers a range in one message, and the client refuses a message over its decoding limit:
//! a whole fleet listed at once cannot be read past that limit (4 MiB by default: 22,000 ordinary
//! worker records, or three values of 1.4 MB written by anyone who may write the prefix). So the
//! range is read [`PAGE_KEYS`] keys at a time, each page continuing after the last key of the one
//! before, every page at the revision of the first so that together they are one consistent
//! snapshot (a watch from that revision + 1 then misses nothing and sees nothing twice). A page over
//! [`DECODE_LIMIT`] is read again with half as many keys; a single key whose value alone is over it
//! is listed without its value ([`Listed::Unreadable`]), and its record is skipped.
//!
//! Invariant: what one page holds in memory is bounded by [`DECODE_LIMIT`], whatever the fleet holds
//! and whoever wrote it.

use peregrine_etcd::{Client, KeyValue, KvClient, pb::etcdserverpb::RangeRequest, prefix_end};
use tonic::transport::Channel;

/// Keys per page: with ordinary records (a worker's is about 200 bytes) a page is about 200 KB.
pub const PAGE_KEYS: i64 = 1000;

/// The largest message read from etcd for one page of the listing. Far above an ordinary page, and
/// above etcd's largest request (`--max-request-bytes`, 1.5 MiB by default) so that an oversized
/// value still reads alone, and its size can be told in the reason it is skipped for.
pub const DECODE_LIMIT: usize = 16 * 1024 * 1024;

/// One key of the listing.
#[derive(Debug)]
pub enum Listed<'a> {
    /// A key and its value.
    Record(&'a KeyValue),
    /// A key whose value alone is over [`DECODE_LIMIT`], listed without it (its lease and revision
    /// are there).
    Unreadable(&'a KeyValue),
}

/// Reads every key under `prefix`, page by page, and hands each to `each` in key order. Returns the
/// revision the whole listing is a snapshot of.
pub async fn list_prefix(
    client: &Client,
    prefix: &str,
    mut each: impl FnMut(Listed<'_>),
) -> Result<i64, peregrine_etcd::Error> {
    let mut kv = client.kv().max_decoding_message_size(DECODE_LIMIT);
    let end = prefix_end(prefix.as_bytes());
    let mut from = prefix.as_bytes().to_vec();
    // Known from the first answer on: every later page is read at it.
    let mut revision = 0;
    let mut limit = PAGE_KEYS;
    loop {
        let request = RangeRequest {
            key: from.clone(),
            range_end: end.clone(),
            limit,
            revision,
            ..RangeRequest::default()
        };
        let page = match kv.range(request).await {
            Ok(page) => page.into_inner(),
            Err(status) if over_decode_limit(&status) && limit > 1 => {
                limit = (limit / 2).max(1);
                continue;
            }
            Err(status) if over_decode_limit(&status) => {
                let key = unreadable(&mut kv, &from, &end, revision).await?;
                if revision == 0 {
                    revision = key.0;
                }
                let Some(key) = key.1 else { break };
                each(Listed::Unreadable(&key));
                from = after(&key.key);
                limit = PAGE_KEYS;
                continue;
            }
            Err(status) => return Err(status.into()),
        };
        if revision == 0 {
            revision = page.header.as_ref().map_or(0, |h| h.revision);
        }
        for kv in &page.kvs {
            each(Listed::Record(kv));
        }
        match page.kvs.last() {
            Some(last) if page.more => from = after(&last.key),
            _ => break,
        }
        // Back towards full pages after a page of large values.
        limit = (limit * 2).min(PAGE_KEYS);
    }
    Ok(revision)
}

/// The first key from `from` without its value: the one whose value could not be read. Returns the
/// revision etcd answered at and the key, if there is one.
async fn unreadable(
    kv: &mut KvClient<Channel>,
    from: &[u8],
    end: &[u8],
    revision: i64,
) -> Result<(i64, Option<KeyValue>), peregrine_etcd::Error> {
    let request = RangeRequest {
        key: from.to_vec(),
        range_end: end.to_vec(),
        limit: 1,
        revision,
        keys_only: true,
        ..RangeRequest::default()
    };
    let page = kv.range(request).await?.into_inner();
    let answered = page.header.as_ref().map_or(0, |h| h.revision);
    Ok((answered, page.kvs.into_iter().next()))
}

/// Whether `status` is the client refusing a message over its decoding limit. tonic says so only
/// in its status (`OUT_OF_RANGE`, which etcd also uses for a compacted or future revision), so its
/// message is the one way to tell.
fn over_decode_limit(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::OutOfRange
        && status.message().contains("message length too large")
}

/// The key right after `key`: `key` and a NUL byte.
fn after(key: &[u8]) -> Vec<u8> {
    let mut next = key.to_vec();
    next.push(0);
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_page_starts_right_after_the_last_key() {
        assert_eq!(after(b"/p/v1/hosts/a"), b"/p/v1/hosts/a\0");
    }

    #[test]
    fn only_the_decoding_limit_counts_as_over_it() {
        let over = tonic::Status::out_of_range(
            "Error, decoded message length too large: found 5000000 bytes, the limit is: 4194304 \
             bytes",
        );
        assert!(over_decode_limit(&over));
        let compacted =
            tonic::Status::out_of_range("etcdserver: mvcc: required revision has been compacted");
        assert!(!over_decode_limit(&compacted));
    }
}
