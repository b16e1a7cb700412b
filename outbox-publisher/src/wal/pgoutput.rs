//! A decoder for the few `pgoutput` (protocol version 1) messages the WAL
//! source reads: Relation, to learn a table's columns, and Insert, a new row
//! as text values. Begin and Commit are parsed by the replication client; Update,
//! Delete, Truncate, Type and Origin are not sent for a publication with
//! `publish = 'insert'` and are skipped if they come.
//!
//! The formats are PostgreSQL's "Logical Replication Message Formats"
//! (protocol chapter 55.9): integers big-endian, strings NUL-terminated.

use bytes::Buf;

/// A table as a Relation message describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Relation {
    pub(crate) id: u32,
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) columns: Vec<String>,
}

/// One column value of a tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    Null,
    /// A TOASTed value not sent (never in an Insert).
    Unchanged,
    Text(String),
    /// A text value whose bytes are not UTF-8 (a database in `SQL_ASCII`):
    /// the row is parked naming it, the rest of the stream goes on.
    NotUtf8,
    /// A binary value (never with the default text format).
    Binary(Vec<u8>),
}

/// A decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message {
    Relation(Relation),
    Insert {
        relation: u32,
        values: Vec<Value>,
    },
    /// Any other message (its tag).
    Other(u8),
}

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError(pub(crate) String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "undecodable pgoutput message: {}", self.0)
    }
}

/// Decodes one message of a replication stream's XLogData.
///
/// # Errors
/// [`DecodeError`] naming what was short or malformed.
pub(crate) fn decode(mut data: &[u8]) -> Result<Message, DecodeError> {
    let tag = take_u8(&mut data, "the message tag")?;
    match tag {
        b'R' => relation(&mut data).map(Message::Relation),
        b'I' => {
            let relation = take_u32(&mut data, "the insert's relation id")?;
            let kind = take_u8(&mut data, "the insert's tuple kind")?;
            if kind != b'N' {
                return Err(DecodeError(format!(
                    "insert tuple kind {:?}, expected 'N'",
                    char::from(kind)
                )));
            }
            let values = tuple(&mut data)?;
            Ok(Message::Insert { relation, values })
        }
        other => Ok(Message::Other(other)),
    }
}

fn relation(data: &mut &[u8]) -> Result<Relation, DecodeError> {
    let id = take_u32(data, "the relation id")?;
    let namespace = take_cstr(data, "the relation's namespace")?;
    let name = take_cstr(data, "the relation's name")?;
    let _identity = take_u8(data, "the replica identity")?;
    let n = take_u16(data, "the column count")?;
    let mut columns = Vec::with_capacity(usize::from(n));
    for _ in 0..n {
        let _flags = take_u8(data, "a column's flags")?;
        columns.push(take_cstr(data, "a column's name")?);
        let _type = take_u32(data, "a column's type")?;
        let _modifier = take_u32(data, "a column's type modifier")?;
    }
    Ok(Relation {
        id,
        namespace,
        name,
        columns,
    })
}

fn tuple(data: &mut &[u8]) -> Result<Vec<Value>, DecodeError> {
    let n = take_u16(data, "the tuple's column count")?;
    let mut values = Vec::with_capacity(usize::from(n));
    for _ in 0..n {
        let kind = take_u8(data, "a value's kind")?;
        values.push(match kind {
            b'n' => Value::Null,
            b'u' => Value::Unchanged,
            b't' | b'b' => {
                let len = usize::try_from(take_u32(data, "a value's length")?)
                    .map_err(|_| DecodeError("a value's length".into()))?;
                if data.len() < len {
                    return Err(DecodeError(format!(
                        "a value of {len} bytes with {} left",
                        data.len()
                    )));
                }
                let (bytes, rest) = data.split_at(len);
                *data = rest;
                if kind == b't' {
                    String::from_utf8(bytes.to_vec()).map_or(Value::NotUtf8, Value::Text)
                } else {
                    Value::Binary(bytes.to_vec())
                }
            }
            other => {
                return Err(DecodeError(format!("value kind {:?}", char::from(other))));
            }
        });
    }
    Ok(values)
}

fn short(what: &str) -> DecodeError {
    DecodeError(format!("the message ends before {what}"))
}

fn take_u8(data: &mut &[u8], what: &str) -> Result<u8, DecodeError> {
    if data.is_empty() {
        return Err(short(what));
    }
    Ok(data.get_u8())
}

fn take_u16(data: &mut &[u8], what: &str) -> Result<u16, DecodeError> {
    if data.len() < 2 {
        return Err(short(what));
    }
    Ok(data.get_u16())
}

fn take_u32(data: &mut &[u8], what: &str) -> Result<u32, DecodeError> {
    if data.len() < 4 {
        return Err(short(what));
    }
    Ok(data.get_u32())
}

fn take_cstr(data: &mut &[u8], what: &str) -> Result<String, DecodeError> {
    let end = data
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| short(what))?;
    let s = String::from_utf8(data[..end].to_vec())
        .map_err(|e| DecodeError(format!("{what} is not UTF-8: {e}")))?;
    *data = &data[end + 1..];
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    fn relation_bytes() -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend_from_slice(&16_385_u32.to_be_bytes());
        cstr(&mut m, "tenant_a");
        cstr(&mut m, "outbox_events");
        m.push(b'd');
        m.extend_from_slice(&2_u16.to_be_bytes());
        for name in ["id", "data"] {
            m.push(1);
            cstr(&mut m, name);
            m.extend_from_slice(&25_u32.to_be_bytes());
            m.extend_from_slice(&u32::MAX.to_be_bytes());
        }
        m
    }

    #[test]
    fn a_relation_names_its_table_and_columns() {
        let m = decode(&relation_bytes());
        assert_eq!(
            m,
            Ok(Message::Relation(Relation {
                id: 16_385,
                namespace: "tenant_a".into(),
                name: "outbox_events".into(),
                columns: vec!["id".into(), "data".into()],
            }))
        );
    }

    #[test]
    fn an_insert_carries_text_nulls_and_empty_values() {
        let mut m = vec![b'I'];
        m.extend_from_slice(&16_385_u32.to_be_bytes());
        m.push(b'N');
        m.extend_from_slice(&3_u16.to_be_bytes());
        m.push(b't');
        m.extend_from_slice(&5_u32.to_be_bytes());
        m.extend_from_slice("{\"a\"".as_bytes());
        m.push(b'}');
        m.push(b'n');
        m.push(b't');
        m.extend_from_slice(&0_u32.to_be_bytes());
        assert_eq!(
            decode(&m),
            Ok(Message::Insert {
                relation: 16_385,
                values: vec![
                    Value::Text("{\"a\"}".into()),
                    Value::Null,
                    Value::Text(String::new())
                ],
            })
        );
    }

    #[test]
    fn short_or_malformed_messages_are_errors_not_panics() {
        let full = relation_bytes();
        for cut in 0..full.len() {
            assert!(decode(&full[..cut]).is_err(), "cut at {cut}");
        }
        let mut m = vec![b'I'];
        m.extend_from_slice(&1_u32.to_be_bytes());
        m.push(b'N');
        m.extend_from_slice(&1_u16.to_be_bytes());
        m.push(b't');
        m.extend_from_slice(&100_u32.to_be_bytes());
        m.extend_from_slice(b"abc");
        assert!(decode(&m).is_err());
        assert_eq!(decode(b"U\0\0"), Ok(Message::Other(b'U')));
    }
}

/// Property tests: [`decode`] answers any bytes with a message or a
/// [`DecodeError`], never a panic.
#[cfg(test)]
mod proptests {
    use proptest::prelude::*;

    use super::*;

    fn config() -> ProptestConfig {
        ProptestConfig {
            failure_persistence: None,
            ..ProptestConfig::with_cases(512)
        }
    }

    /// The tag of every pgoutput message of protocol versions 1 to 4.
    const TAGS: &[u8] = b"BCORYIUDTMSEcAbPKrps";

    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    /// A string a Relation can carry: no NUL.
    fn name() -> impl Strategy<Value = String> {
        any::<String>().prop_map(|s| s.replace('\0', ""))
    }

    fn relation() -> impl Strategy<Value = Relation> {
        (
            any::<u32>(),
            name(),
            name(),
            prop::collection::vec(name(), 0..12),
        )
            .prop_map(|(id, namespace, name, columns)| Relation {
                id,
                namespace,
                name,
                columns,
            })
    }

    fn relation_bytes(r: &Relation, identity: u8, types: &[(u8, u32, u32)]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend_from_slice(&r.id.to_be_bytes());
        cstr(&mut m, &r.namespace);
        cstr(&mut m, &r.name);
        m.push(identity);
        m.extend_from_slice(&u16::try_from(r.columns.len()).unwrap().to_be_bytes());
        for (i, column) in r.columns.iter().enumerate() {
            let (flags, oid, modifier) = types.get(i).copied().unwrap_or((0, 25, u32::MAX));
            m.push(flags);
            cstr(&mut m, column);
            m.extend_from_slice(&oid.to_be_bytes());
            m.extend_from_slice(&modifier.to_be_bytes());
        }
        m
    }

    /// A value and the bytes it is sent as.
    fn value() -> impl Strategy<Value = (Value, Vec<u8>)> {
        fn sized(kind: u8, bytes: &[u8]) -> Vec<u8> {
            let mut out = vec![kind];
            out.extend_from_slice(&u32::try_from(bytes.len()).unwrap().to_be_bytes());
            out.extend_from_slice(bytes);
            out
        }
        prop_oneof![
            Just((Value::Null, vec![b'n'])),
            Just((Value::Unchanged, vec![b'u'])),
            any::<String>().prop_map(|s| {
                let bytes = sized(b't', s.as_bytes());
                (Value::Text(s), bytes)
            }),
            // 0xFF is never in UTF-8.
            prop::collection::vec(any::<u8>(), 0..32).prop_map(|mut b| {
                b.insert(0, 0xFF);
                (Value::NotUtf8, sized(b't', &b))
            }),
            prop::collection::vec(any::<u8>(), 0..32)
                .prop_map(|b| (Value::Binary(b.clone()), sized(b'b', &b))),
        ]
    }

    fn insert() -> impl Strategy<Value = (Message, Vec<u8>)> {
        (any::<u32>(), prop::collection::vec(value(), 0..12)).prop_map(|(relation, values)| {
            let mut m = vec![b'I'];
            m.extend_from_slice(&relation.to_be_bytes());
            m.push(b'N');
            m.extend_from_slice(&u16::try_from(values.len()).unwrap().to_be_bytes());
            for (_, bytes) in &values {
                m.extend_from_slice(bytes);
            }
            let values = values.into_iter().map(|(v, _)| v).collect();
            (Message::Insert { relation, values }, m)
        })
    }

    /// A Relation or an Insert built by hand, and the message it decodes to.
    fn valid() -> impl Strategy<Value = (Message, Vec<u8>)> {
        prop_oneof![
            (
                relation(),
                any::<u8>(),
                prop::collection::vec(any::<(u8, u32, u32)>(), 0..12)
            )
                .prop_map(|(r, identity, types)| {
                    let bytes = relation_bytes(&r, identity, &types);
                    (Message::Relation(r), bytes)
                }),
            insert(),
        ]
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn any_bytes_decode_or_err(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn any_tag_with_any_body_decodes_or_errs(
            tag in prop::sample::select(TAGS),
            body in prop::collection::vec(any::<u8>(), 0..512),
        ) {
            let mut m = vec![tag];
            m.extend_from_slice(&body);
            match decode(&m) {
                Ok(Message::Other(other)) => prop_assert_eq!(other, tag),
                Ok(Message::Relation(_)) => prop_assert_eq!(tag, b'R'),
                Ok(Message::Insert { .. }) => prop_assert_eq!(tag, b'I'),
                Err(e) => prop_assert!(tag == b'R' || tag == b'I', "{}", e),
            }
        }

        #[test]
        fn an_insert_header_with_any_tuple_decodes_or_errs(
            relation in any::<u32>(),
            count in prop_oneof![0_u16..16, any::<u16>()],
            tuple in prop::collection::vec(any::<u8>(), 0..256),
        ) {
            // Mostly the bytes of value kinds and short lengths.
            let tuple = tuple.iter().map(|&b| match b {
                0..=159 => b"nutb\0\xFF\0\x01"[usize::from(b % 8)],
                _ => b,
            });
            let mut m = vec![b'I'];
            m.extend_from_slice(&relation.to_be_bytes());
            m.push(b'N');
            m.extend_from_slice(&count.to_be_bytes());
            m.extend(tuple);
            if let Ok(Message::Insert { values, .. }) = decode(&m) {
                prop_assert_eq!(values.len(), usize::from(count));
            }
        }

        #[test]
        fn a_message_built_by_hand_decodes_and_every_truncation_errs(
            (message, bytes) in valid(),
        ) {
            prop_assert_eq!(decode(&bytes), Ok(message));
            for cut in 0..bytes.len() {
                prop_assert!(decode(&bytes[..cut]).is_err(), "cut at {}", cut);
            }
        }

        #[test]
        fn a_message_built_by_hand_with_bytes_changed_decodes_or_errs(
            (_, mut bytes) in valid(),
            changes in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
            tail in prop::collection::vec(any::<u8>(), 0..16),
        ) {
            for (at, byte) in changes {
                let i = at.index(bytes.len());
                bytes[i] = byte;
            }
            let _ = decode(&bytes);
            bytes.extend_from_slice(&tail);
            let _ = decode(&bytes);
        }

        #[test]
        fn a_length_past_the_end_is_an_error(
            kind in prop::sample::select(&b"tb"[..]),
            len in any::<u32>(),
            body in prop::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut m = vec![b'I'];
            m.extend_from_slice(&1_u32.to_be_bytes());
            m.push(b'N');
            m.extend_from_slice(&1_u16.to_be_bytes());
            m.push(kind);
            m.extend_from_slice(&len.to_be_bytes());
            m.extend_from_slice(&body);
            let decoded = decode(&m);
            if usize::try_from(len).unwrap() > body.len() {
                prop_assert!(decoded.is_err());
            } else {
                prop_assert!(decoded.is_ok(), "{:?}", decoded);
            }
        }
    }
}
