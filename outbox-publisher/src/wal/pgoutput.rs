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
