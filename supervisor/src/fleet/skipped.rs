//! The other hosts' records that are skipped, remembered so that each is logged once: when it
//! appears, and again only when it is written anew or skipped for another reason. A host's records
//! are read again at every change of that host, so logging every skipped record at every read
//! logged each bad record once per later write to its host: quadratic in the number of bad records
//! (300 of them written one by one made 45,150 lines).
//!
//! Invariant: what is remembered is what the view last skipped, key by key; a key read again and
//! found fine, or gone, is forgotten, so it is logged again if it turns bad again.

use std::collections::BTreeMap;

use super::records::RecordError;

/// Every reason a record is skipped for ([`RecordError::reason`]): each is a series of the
/// skipped-records metric, 0 when no record is skipped for it.
pub const REASONS: [&str; 9] = [
    "too_large",
    "shape",
    "value",
    "name",
    "no_lease",
    "no_host",
    "other_lease",
    "address",
    "spec",
];

/// The records skipped now, by key: the revision each was skipped at, and why.
#[derive(Debug, Default)]
pub struct SkippedRecords {
    by_key: BTreeMap<String, (i64, &'static str)>,
}

impl SkippedRecords {
    /// Takes what one read of the view skipped, `now` (each key with its revision and why), for the
    /// keys `read` says that read covered. Returns those of `now` to log: the new ones, and those
    /// written anew or skipped for another reason since. Keys covered and not skipped any more are
    /// forgotten.
    pub fn update(
        &mut self,
        read: impl Fn(&str) -> bool,
        now: Vec<(String, i64, RecordError)>,
    ) -> Vec<(String, RecordError)> {
        let skipped_now: BTreeMap<&str, ()> =
            now.iter().map(|(k, _, _)| (k.as_str(), ())).collect();
        self.by_key
            .retain(|key, _| !read(key) || skipped_now.contains_key(key.as_str()));
        let mut fresh = Vec::new();
        for (key, revision, error) in now {
            let seen = (revision, error.reason());
            if self.by_key.get(&key) != Some(&seen) {
                self.by_key.insert(key.clone(), seen);
                fresh.push((key, error));
            }
        }
        fresh
    }

    /// How many records are skipped, by reason (every one of [`REASONS`]).
    pub fn counts(&self) -> BTreeMap<&'static str, usize> {
        let mut counts: BTreeMap<&'static str, usize> = REASONS.iter().map(|r| (*r, 0)).collect();
        for (_, reason) in self.by_key.values() {
            *counts.entry(reason).or_default() += 1;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bad(key: &str, revision: i64) -> (String, i64, RecordError) {
        (key.to_owned(), revision, RecordError::NotUtf8)
    }

    #[test]
    fn a_record_is_logged_when_it_appears_or_changes_and_forgotten_when_gone() {
        let mut skipped = SkippedRecords::default();
        let everything = |_: &str| true;
        let fresh = skipped.update(everything, vec![bad("a", 1), bad("b", 2)]);
        assert_eq!(fresh.len(), 2);
        // Read again unchanged, with one more: only the new one is logged.
        let fresh = skipped.update(everything, vec![bad("a", 1), bad("b", 2), bad("c", 3)]);
        assert_eq!(
            fresh.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            ["c"]
        );
        // Written anew: logged again. Skipped for another reason: logged again.
        let other = ("b".to_owned(), 2, RecordError::NoHost);
        let fresh = skipped.update(everything, vec![bad("a", 4), other, bad("c", 3)]);
        assert_eq!(
            fresh.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(skipped.counts()["shape"], 2);
        assert_eq!(skipped.counts()["no_host"], 1);
        assert_eq!(skipped.counts().len(), REASONS.len());
        // A read of some keys leaves the others as they were; a key read and not skipped goes.
        let fresh = skipped.update(|key| key == "c", Vec::new());
        assert!(fresh.is_empty());
        assert_eq!(skipped.counts()["shape"], 1, "a is kept, c forgotten");
        let fresh = skipped.update(everything, vec![bad("c", 3)]);
        assert_eq!(fresh.len(), 1, "c turned bad again");
    }
}
