//! The reference the JSON span scanner is checked against: the serde_json `RawValue` parse it
//! replaced (keys decoded, values as their exact text; `is_json` is UTF-8 plus serde_json's
//! skipping). Used by the property tests (property_tests.rs) and the fuzz target
//! (src/fuzzing.rs); never on the data path.

use std::borrow::Cow;

use serde_json::value::RawValue;

use super::faults::Fault;

pub fn is_json(body: &[u8]) -> bool {
    std::str::from_utf8(body).is_ok_and(|text| serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok())
}

pub fn members(body: &[u8]) -> Result<Vec<(String, String)>, Fault> {
    match serde_json::from_slice::<Object>(body) {
        Ok(object) => Ok(object.0),
        Err(_) if !body.trim_ascii_start().starts_with(b"{") && is_json(body) => Err(Fault::NotObject),
        Err(_) => Err(Fault::NotJson),
    }
}

struct Object(Vec<(String, String)>);

impl<'de> serde::Deserialize<'de> for Object {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor;
        impl<'de> serde::de::Visitor<'de> for ObjectVisitor {
            type Value = Object;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Object, A::Error> {
                let mut members = Vec::new();
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    let value: &'de RawValue = map.next_value()?;
                    members.push((key.into_owned(), value.get().to_owned()));
                }
                Ok(Object(members))
            }
        }
        deserializer.deserialize_map(ObjectVisitor)
    }
}
