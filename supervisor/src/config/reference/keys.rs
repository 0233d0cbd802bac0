//! Every key of `peregrine.toml`, as the parser's serde mirror ([`RawConfig`]) asks for them.
//!
//! [`keys`] walks the mirror with a deserializer that holds no data: asked for a struct, it records
//! the struct's field names under the current path and then hands each field a walker of its own;
//! asked for a map (`[service.NAME]`, a service's `env`), it hands out one entry named `NAME`; asked
//! for a number, a text, a flag or a list, it gives an empty one. What serde asks for is exactly what
//! the file may hold, since every table of the mirror denies unknown fields.
//!
//! Why not `serde-reflection`, which traces types the same way: the mirror wraps its values in
//! `toml::Spanned`, whose `Deserialize` asks for a struct with private field names and accepts it only
//! as a map, which a tracer that answers structs with sequences cannot give; and the walk here is all
//! the reference test needs, in a page of code and without a dependency.
//!
//! [`RawConfig`]: super::super::raw::RawConfig

use std::{cell::RefCell, collections::BTreeSet};

use serde::de::{
    self, Deserialize, DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, SeqAccess,
    Visitor, value::BorrowedStrDeserializer,
};

/// The name `toml::Spanned` asks a deserializer for (serde_spanned's private protocol): such a
/// struct is walked through, its value taking the path of the key it spans.
const SPANNED: &str = "$__serde_spanned_private_Spanned";

/// The name given to a map's one entry: `service.NAME`.
pub(super) const MAP_ENTRY: &str = "NAME";

/// The dotted keys whose values are not tables (`supervisor.bind`, `service.NAME.env`), found by
/// walking `T`'s `Deserialize`.
pub(super) fn keys<T: for<'de> Deserialize<'de>>() -> Result<BTreeSet<String>, de::value::Error> {
    let fields = RefCell::new(BTreeSet::new());
    T::deserialize(Walker {
        path: String::new(),
        fields: &fields,
    })?;
    let fields = fields.into_inner();
    // A field with fields below it is a table (`supervisor.tls`, `service`), not a key.
    let tables: BTreeSet<&String> = fields
        .iter()
        .filter(|field| {
            let below = format!("{field}.");
            fields.iter().any(|other| other.starts_with(&below))
        })
        .collect();
    Ok(fields
        .iter()
        .filter(|field| !tables.contains(field))
        .cloned()
        .collect())
}

/// Walks one value at `path`, recording the fields of every struct below it into `fields`.
struct Walker<'a> {
    path: String,
    fields: &'a RefCell<BTreeSet<String>>,
}

impl<'a> Walker<'a> {
    fn child(&self, name: &str) -> Walker<'a> {
        let path = if self.path.is_empty() {
            name.to_owned()
        } else {
            format!("{}.{name}", self.path)
        };
        Walker {
            path,
            fields: self.fields,
        }
    }

    fn unknown(&self, what: &str) -> de::value::Error {
        de::Error::custom(format!(
            "{}: the key walk does not know how to give {what}; teach reference::keys",
            self.path
        ))
    }
}

// === impl Walker ===

impl<'de> Deserializer<'de> for Walker<'_> {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("a value of any type"))
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_bool(false)
    }

    fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_i64(0)
    }

    fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_u64(0)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_borrowed_str("")
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_borrowed_str("")
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_seq(Empty)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_some(self)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        let entry = self.child(MAP_ENTRY);
        visitor.visit_map(Fields {
            names: [MAP_ENTRY].iter(),
            parent: entry,
            as_entry: true,
        })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        if name == SPANNED {
            return visitor.visit_map(Spanned {
                fields: fields.iter(),
                value: Some(self),
            });
        }
        for field in fields {
            self.fields.borrow_mut().insert(self.child(field).path);
        }
        visitor.visit_map(Fields {
            names: fields.iter(),
            parent: self,
            as_entry: false,
        })
    }

    fn deserialize_i8<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("an i8"))
    }
    fn deserialize_i16<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("an i16"))
    }
    fn deserialize_i32<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("an i32"))
    }
    fn deserialize_u8<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("a u8"))
    }
    fn deserialize_u16<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("a u16"))
    }
    fn deserialize_u32<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("a u32"))
    }
    fn deserialize_f32<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("an f32"))
    }
    fn deserialize_f64<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("an f64"))
    }
    fn deserialize_char<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("a char"))
    }
    fn deserialize_bytes<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("bytes"))
    }
    fn deserialize_byte_buf<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("bytes"))
    }
    fn deserialize_unit<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("a unit"))
    }
    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: V,
    ) -> Result<V::Value, Self::Error> {
        Err(self.unknown("a unit struct"))
    }
    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: V,
    ) -> Result<V::Value, Self::Error> {
        Err(self.unknown("a newtype struct"))
    }
    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("a tuple"))
    }
    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        _: V,
    ) -> Result<V::Value, Self::Error> {
        Err(self.unknown("a tuple struct"))
    }
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        Err(self.unknown("an enum"))
    }
    fn deserialize_identifier<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("an identifier"))
    }
    fn deserialize_ignored_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(self.unknown("an ignored value"))
    }
}

/// A struct's fields (or a map's one entry), each key followed by a walk of its value.
struct Fields<'a> {
    names: std::slice::Iter<'static, &'static str>,
    /// The struct's walker; for a map, the walker of its one entry's value.
    parent: Walker<'a>,
    /// Whether these are a map's entries, whose values are walked at `parent` itself.
    as_entry: bool,
}

impl<'de> MapAccess<'de> for Fields<'_> {
    type Error = de::value::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        match self.names.clone().next() {
            Some(name) => seed
                .deserialize(BorrowedStrDeserializer::new(name))
                .map(Some),
            None => Ok(None),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let name = self.names.next().expect("a key was given first");
        let walker = if self.as_entry {
            Walker {
                path: self.parent.path.clone(),
                fields: self.parent.fields,
            }
        } else {
            self.parent.child(name)
        };
        seed.deserialize(walker)
    }
}

/// `toml::Spanned`'s three fields: a span (`0..0`) and the value, walked at the spanned key's path.
struct Spanned<'a> {
    fields: std::slice::Iter<'static, &'static str>,
    value: Option<Walker<'a>>,
}

impl<'de> MapAccess<'de> for Spanned<'_> {
    type Error = de::value::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        match self.fields.clone().next() {
            Some(name) => seed
                .deserialize(BorrowedStrDeserializer::new(name))
                .map(Some),
            None => Ok(None),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let name = self.fields.next().expect("a key was given first");
        if name.ends_with("_value") {
            let walker = self.value.take().expect("one value");
            seed.deserialize(walker)
        } else {
            seed.deserialize(0_u64.into_deserializer())
        }
    }
}

/// An empty list.
struct Empty;

impl<'de> SeqAccess<'de> for Empty {
    type Error = de::value::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        _: T,
    ) -> Result<Option<T::Value>, Self::Error> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::Deserialize;
    use toml::Spanned;

    use super::keys;

    #[derive(Deserialize)]
    #[allow(dead_code, reason = "only the shape is read")]
    struct Outer {
        plain: u64,
        flag: Option<Spanned<bool>>,
        inner: Option<Spanned<Inner>>,
        named: BTreeMap<String, Inner>,
    }

    #[derive(Deserialize)]
    #[allow(dead_code, reason = "only the shape is read")]
    struct Inner {
        text: Option<Spanned<String>>,
        list: Vec<i64>,
        map: Option<Spanned<BTreeMap<String, String>>>,
    }

    #[test]
    fn the_walk_finds_keys_through_spans_options_and_maps() {
        let found: Vec<String> = keys::<Outer>().unwrap().into_iter().collect();
        assert_eq!(
            found,
            [
                "flag",
                "inner.list",
                "inner.map",
                "inner.text",
                "named.NAME.list",
                "named.NAME.map",
                "named.NAME.text",
                "plain",
            ]
        );
    }

    #[test]
    fn a_type_the_walk_does_not_know_is_named() {
        #[derive(Deserialize, Debug)]
        #[allow(dead_code, reason = "only the shape is read")]
        struct Odd {
            ratio: f64,
        }
        let error = keys::<Odd>().unwrap_err().to_string();
        assert!(error.contains("ratio") && error.contains("f64"), "{error}");
    }
}
