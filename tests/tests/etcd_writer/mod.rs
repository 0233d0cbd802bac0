//! A client of an etcd for the tests that write a fleet's keys themselves, as a host or an intruder
//! would, through the supervisor's own etcd calls (`peregrine-etcd`).

use std::time::Duration;

/// A client of an etcd for tests that write a fleet's keys themselves, as a host or an intruder
/// would: blocking calls, on a runtime of its own.
pub(crate) struct EtcdClient {
    runtime: tokio::runtime::Runtime,
    client: peregrine_etcd::Client,
}

impl std::fmt::Debug for EtcdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdClient").finish_non_exhaustive()
    }
}

/// The most operations etcd takes in one transaction (`--max-txn-ops`, 128 by default).
const TXN_OPS: usize = 128;

impl EtcdClient {
    /// A client of the cleartext endpoint `endpoint` (`http://IP:PORT`).
    pub(crate) fn connect(endpoint: &str) -> anyhow::Result<EtcdClient> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let options = peregrine_etcd::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(30));
        let client =
            runtime.block_on(peregrine_etcd::Client::connect([endpoint], Some(options)))?;
        Ok(EtcdClient { runtime, client })
    }

    /// A lease of `ttl` (whole seconds), not kept alive: choose it longer than the test.
    pub(crate) fn grant(&self, ttl: Duration) -> anyhow::Result<i64> {
        Ok(self
            .runtime
            .block_on(self.client.lease_grant(ttl.as_secs() as i64))?)
    }

    /// Revokes `lease`: every key under it is deleted, at one revision.
    pub(crate) fn revoke(&self, lease: i64) -> anyhow::Result<()> {
        Ok(self.runtime.block_on(self.client.lease_revoke(lease))?)
    }

    /// Puts `value` at `key`, attached to `lease` (0: none).
    pub(crate) fn put(
        &self,
        key: &str,
        value: impl Into<Vec<u8>>,
        lease: i64,
    ) -> anyhow::Result<()> {
        self.runtime.block_on(self.client.put(key, value, lease))?;
        Ok(())
    }

    /// Puts every key and value, attached to `lease` (0: none), as many to a transaction as etcd
    /// takes.
    pub(crate) fn put_all(&self, kvs: &[(String, String)], lease: i64) -> anyhow::Result<()> {
        self.runtime.block_on(async {
            for chunk in kvs.chunks(TXN_OPS) {
                let ops = chunk
                    .iter()
                    .map(|(key, value)| peregrine_etcd::put_op(key.as_str(), value.as_str(), lease))
                    .collect();
                self.client.txn(ops).await?;
            }
            anyhow::Ok(())
        })
    }

    /// Deletes every key under `prefix`; returns how many there were.
    pub(crate) fn delete_prefix(&self, prefix: &str) -> anyhow::Result<i64> {
        Ok(self
            .runtime
            .block_on(self.client.delete_prefix(prefix.as_bytes()))?)
    }

    /// How many keys there are under `prefix`.
    pub(crate) fn count_prefix(&self, prefix: &str) -> anyhow::Result<i64> {
        Ok(self
            .runtime
            .block_on(self.client.count_prefix(prefix.as_bytes()))?)
    }
}
