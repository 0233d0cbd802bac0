//! Which resources of one type a stream has yet to look at, so that a pass over the cache's
//! resources costs what changed, not what is subscribed.
//!
//! Each resource carries the serial of its set at which it took its version
//! ([`VersionedResource::serial`]). A stream that looked at a set of serial `s` need look again
//! only at resources of a higher serial, and at the names it put back ([`Looked::again`]: held for
//! their cluster, or owed again though unchanged). A stream that never looked looks at every
//! resource. A pass that stops because its response is full ([`Looked::stop`]) has looked at the
//! names before the one it stopped at; the next pass goes on from there.
//!
//! With 1,000 streams subscribed to 100 clusters each, one changed cluster costs each stream a
//! scan of 100 serials (integers) per pass instead of merging 100 names with three maps of names:
//! the string comparisons were most of the supervisor's CPU per change. A burst that changed every
//! cluster costs each response of its pieces only the names it carries.
//!
//! Invariant: a resource owed to a stream and not sent is of a serial above the one its name was
//! last looked at, or named in `again`; so nothing owed is ever skipped.

use std::{collections::BTreeSet, ops::Bound};

use crate::xds::cache::{TypeResources, VersionedResource};

/// One response's resources, as [`Looked::fill`] chose them.
#[derive(Debug, Default)]
pub(super) struct Filled<'a> {
    /// What goes in the response, in name order.
    pub(super) resources: Vec<&'a VersionedResource>,
    /// Whether anything owed was held back (for the next response, or for its cluster).
    pub(super) held: bool,
}

/// What a stream looked at in one type's resources.
#[derive(Debug, Default)]
pub(super) struct Looked {
    /// The serial up to which every name (at or after the stop, if one is set) was looked at;
    /// `None`: never.
    at: Option<u64>,
    /// Where the last pass stopped, and the serial up to which the names before it were looked at.
    stop: Option<(String, u64)>,
    /// Names to look at again whatever their serial.
    again: BTreeSet<String>,
    /// The serial of the set whose removals were last dealt with; `None`: never.
    pruned: Option<u64>,
}

impl Looked {
    /// The next look is at every resource (a new subscription: what was sent no longer counts).
    pub(super) fn forget(&mut self) {
        *self = Looked::default();
    }

    /// The next look includes `name` whatever its serial.
    pub(super) fn again(&mut self, name: &str) {
        if !self.again.contains(name) {
            self.again.insert(name.to_owned());
        }
    }

    /// Whether a resource was removed from `set` since the last call that said so (or this is the
    /// first call): what the stream recorded for names no longer in `set` is to be dropped, and the
    /// caller does so now.
    pub(super) fn removals(&mut self, set: &TypeResources) -> bool {
        let removed = self.pruned.is_none_or(|at| set.last_removal > at);
        self.pruned = Some(set.serial);
        removed
    }

    /// Whether a look at `set` would find nothing: every name was looked at at its serial, and none
    /// was put back.
    pub(super) fn done(&self, set: &TypeResources) -> bool {
        self.at == Some(set.serial) && self.stop.is_none() && self.again.is_empty()
    }

    /// The resources of `set` to look at, in name order. The caller then says how the look ended:
    /// [`Looked::finish`] or [`Looked::stop`].
    pub(super) fn look<'a>(&self, set: &'a TypeResources) -> Vec<&'a VersionedResource> {
        let newer = |r: &VersionedResource, at: Option<u64>| at.is_none_or(|at| r.serial > at);
        let mut out = Vec::new();
        let mut again = self.again.iter().peekable();
        let mut put_back = |r: &VersionedResource| {
            let mut found = false;
            while let Some(name) = again.next_if(|n| n.as_str() <= r.name.as_str()) {
                found |= *name == r.name;
            }
            found
        };
        let (front, back) = match &self.stop {
            Some((name, _)) => (
                set.resources
                    .range::<str, _>((Bound::Unbounded, Bound::Excluded(name.as_str()))),
                set.resources
                    .range::<str, _>((Bound::Included(name.as_str()), Bound::Unbounded)),
            ),
            None => (
                set.resources
                    .range::<str, _>((Bound::Unbounded, Bound::Excluded(""))),
                set.resources
                    .range::<str, _>((Bound::Unbounded, Bound::Unbounded)),
            ),
        };
        let front_at = self.stop.as_ref().map(|&(_, at)| at);
        for r in front.map(|(_, r)| r) {
            if newer(r, front_at) || put_back(r) {
                out.push(r);
            }
        }
        for r in back.map(|(_, r)| r) {
            if newer(r, self.at) || put_back(r) {
                out.push(r);
            }
        }
        out
    }

    /// Fills one response from `set`, the rule both variants follow: of the resources to look at,
    /// in name order, those `owed` (subscribed, and the client does not have them as they are) and
    /// `sendable` go in until one would take the response past `limit` bytes (the first always
    /// goes), where the look stops; those owed and not sendable (their cluster not sent yet) are put
    /// back.
    pub(super) fn fill<'a>(
        &mut self,
        set: &'a TypeResources,
        owed: impl Fn(&VersionedResource) -> bool,
        sendable: impl Fn(&str) -> bool,
        limit: usize,
    ) -> Filled<'a> {
        let mut filled = Filled::default();
        let mut bytes = 0;
        let mut unsendable = Vec::new();
        let mut stopped = None;
        for r in self.look(set) {
            if !owed(r) {
                continue;
            }
            if !sendable(&r.name) {
                unsendable.push(r.name.as_str());
                continue;
            }
            let size = r.resource.value.len();
            if !filled.resources.is_empty() && bytes + size > limit {
                stopped = Some(r.name.as_str());
                break;
            }
            bytes += size;
            filled.resources.push(r);
        }
        match stopped {
            Some(name) => self.stop(set, name),
            None => self.finish(set),
        }
        for name in &unsendable {
            self.again(name);
        }
        filled.held = stopped.is_some() || !unsendable.is_empty();
        filled
    }

    /// The look at `set` went through every resource it was given.
    pub(super) fn finish(&mut self, set: &TypeResources) {
        self.at = Some(set.serial);
        self.stop = None;
        self.again.clear();
    }

    /// The look at `set` stopped before `name` (the response was full): the names before it were
    /// looked at, it and those after are looked at again next time.
    pub(super) fn stop(&mut self, set: &TypeResources, name: &str) {
        // The names from `name` on keep the lowest serial any of them was looked at (`at`: a
        // stop only ever moves the names before it forward).
        self.stop = Some((name.to_owned(), set.serial));
        self.again = self.again.split_off(name);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use envoy_types::pb::google::protobuf::Any;

    use super::*;

    fn set(serial: u64, last_removal: u64, resources: &[(&str, u64)]) -> TypeResources {
        TypeResources {
            type_url: "t",
            version: format!("e-{serial}"),
            serial,
            last_removal,
            resources: resources
                .iter()
                .map(|&(name, serial)| {
                    let r = VersionedResource {
                        name: name.to_owned(),
                        version: serial.to_string(),
                        resource: Any::default(),
                        serial,
                    };
                    (name.to_owned(), r)
                })
                .collect::<BTreeMap<_, _>>(),
        }
    }

    fn names(resources: &[&VersionedResource]) -> Vec<String> {
        resources.iter().map(|r| r.name.clone()).collect()
    }

    /// Looks at `set` through to the end.
    fn look_through(looked: &mut Looked, set: &TypeResources) -> Vec<String> {
        let out = names(&looked.look(set));
        looked.finish(set);
        out
    }

    #[test]
    fn a_first_look_sees_everything_then_only_what_changed() {
        let mut looked = Looked::default();
        let one = set(1, 0, &[("a", 1), ("b", 1), ("c", 1)]);
        assert!(!looked.done(&one));
        assert_eq!(look_through(&mut looked, &one), ["a", "b", "c"]);
        assert!(looked.done(&one));
        let two = set(2, 0, &[("a", 1), ("b", 2), ("c", 1)]);
        assert!(!looked.done(&two));
        assert_eq!(look_through(&mut looked, &two), ["b"]);
        assert!(looked.done(&two));
        assert!(look_through(&mut looked, &two).is_empty());
    }

    #[test]
    fn names_put_back_are_looked_at_again_once() {
        let mut looked = Looked::default();
        let one = set(1, 0, &[("a", 1), ("b", 1), ("c", 1)]);
        look_through(&mut looked, &one);
        looked.again("c");
        looked.again("a");
        looked.again("gone");
        assert!(!looked.done(&one));
        let two = set(2, 0, &[("a", 1), ("b", 2), ("c", 1)]);
        assert_eq!(look_through(&mut looked, &two), ["a", "b", "c"]);
        assert!(look_through(&mut looked, &two).is_empty());
    }

    #[test]
    fn a_stopped_look_goes_on_from_where_it_stopped() {
        let mut looked = Looked::default();
        let one = set(1, 0, &[("a", 1), ("b", 1), ("c", 1), ("d", 1)]);
        assert_eq!(names(&looked.look(&one)), ["a", "b", "c", "d"]);
        looked.again("d");
        looked.stop(&one, "c");
        assert!(!looked.done(&one));
        // A change before the stop meanwhile, and one after it.
        let two = set(2, 0, &[("a", 2), ("b", 1), ("c", 1), ("d", 1), ("e", 2)]);
        assert_eq!(names(&looked.look(&two)), ["a", "c", "d", "e"]);
        looked.stop(&two, "d");
        assert_eq!(look_through(&mut looked, &two), ["d", "e"]);
        assert!(looked.done(&two));
        // A stop before an earlier one looks again at what lies between, newer than the lower of
        // the two serials (it cannot tell what was looked at).
        let three = set(3, 0, &[("a", 3), ("b", 1), ("c", 1), ("d", 3), ("e", 2)]);
        assert_eq!(names(&looked.look(&three)), ["a", "d"]);
        looked.stop(&three, "d");
        let four = set(4, 0, &[("a", 3), ("b", 4), ("c", 1), ("d", 3), ("e", 2)]);
        assert_eq!(names(&looked.look(&four)), ["b", "d"]);
        looked.stop(&four, "b");
        assert_eq!(look_through(&mut looked, &four), ["b", "d"]);
        assert!(looked.done(&four));
    }

    #[test]
    fn removals_are_told_once_and_a_forget_means_a_whole_look() {
        let mut looked = Looked::default();
        let one = set(1, 0, &[("a", 1), ("b", 1)]);
        assert!(looked.removals(&one));
        look_through(&mut looked, &one);
        assert!(!looked.removals(&one));
        let two = set(2, 2, &[("a", 1)]);
        assert!(!looked.done(&two));
        assert!(looked.removals(&two));
        assert!(!looked.removals(&two));
        assert!(look_through(&mut looked, &two).is_empty());
        looked.forget();
        assert!(looked.removals(&two));
        assert_eq!(look_through(&mut looked, &two), ["a"]);
    }
}
