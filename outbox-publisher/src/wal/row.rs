//! An inserted `outbox_events` row, as `pgoutput` sends it (text values, in
//! the table's column order), made into the row a claim would have read.
//!
//! The replication session pins `TimeZone=UTC` and `DateStyle=ISO`, so a
//! `timestamptz` arrives as `2026-12-02 16:07:46.123456+00`. As in the claim,
//! a value no client can decode never fails the stream: an infinite time or
//! one outside years 1–9999 becomes `None`, text that is not UTF-8 a decode
//! error, and either parks only its own row (`relay/message.rs`).

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::pgoutput::{Relation, Value};
use crate::error::{Error, ErrorKind, Result};
use crate::store::ClaimedRow;

/// Where the columns the relay reads sit in an `outbox_events` tuple.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    id: usize,
    seq: usize,
    /// A generated column, which pgoutput does not send (PostgreSQL 15);
    /// the WAL source does not need it.
    shard: Option<usize>,
    event_type: usize,
    source: usize,
    subject: usize,
    time: usize,
    data: usize,
    created_at: Option<usize>,
    attempts: Option<usize>,
    traceparent: Option<usize>,
    tracestate: Option<usize>,
    published_at: Option<usize>,
    next_attempt_at: Option<usize>,
}

/// What an insert is to the WAL source.
#[derive(Debug)]
pub(crate) enum Inserted {
    /// A row of the main lane: to publish.
    Fresh(Box<ClaimedRow>),
    /// A row inserted already published or already in the retry lane (an
    /// import, a copy): not the WAL source's to publish.
    NotFresh,
}

impl Layout {
    /// The layout of `relation`.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] naming a column the relay needs that the table lacks.
    pub(crate) fn of(relation: &Relation) -> Result<Self> {
        let find = |name: &str| relation.columns.iter().position(|c| c == name);
        let need = |name: &str| {
            find(name).ok_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    format!(
                        "{}.{} as the replication stream describes it has no column `{name}`: \
                         run the outbox migrations (outbox_pg::migrate)",
                        relation.namespace, relation.name
                    ),
                )
            })
        };
        Ok(Self {
            id: need("id")?,
            seq: need("seq")?,
            shard: find("shard"),
            event_type: need("event_type")?,
            source: need("source")?,
            subject: need("subject")?,
            time: need("time")?,
            data: need("data")?,
            created_at: find("created_at"),
            attempts: find("attempts"),
            traceparent: find("traceparent"),
            tracestate: find("tracestate"),
            published_at: find("published_at"),
            next_attempt_at: find("next_attempt_at"),
        })
    }

    /// The row of an insert's `values`; `max_payload` bounds the data kept.
    pub(crate) fn row(&self, mut values: Vec<Value>, max_payload: usize) -> Inserted {
        let present = |i: Option<usize>| {
            i.is_some_and(|i| !matches!(values.get(i), None | Some(Value::Null)))
        };
        if present(self.published_at) || present(self.next_attempt_at) {
            return Inserted::NotFresh;
        }
        let mut errors: Vec<String> = Vec::new();
        // Each column is read once: its text is moved out, not copied.
        let mut text = |i: usize, name: &str| -> Option<String> {
            match values.get_mut(i).map(|v| std::mem::replace(v, Value::Null)) {
                Some(Value::Text(s)) => Some(s),
                Some(Value::Null) | None => None,
                Some(Value::NotUtf8) => {
                    errors.push(format!("{name} is not UTF-8"));
                    None
                }
                Some(Value::Unchanged | Value::Binary(_)) => {
                    errors.push(format!("{name} came without its text value"));
                    None
                }
            }
        };
        let id = text(self.id, "id");
        let seq = text(self.seq, "seq");
        let shard = self.shard.and_then(|i| text(i, "shard"));
        let event_type = text(self.event_type, "event_type").unwrap_or_default();
        let source = text(self.source, "source").unwrap_or_default();
        let subject = text(self.subject, "subject").unwrap_or_default();
        let time = text(self.time, "time");
        let data = text(self.data, "data");
        let created_at = self.created_at.and_then(|i| text(i, "created_at"));
        let attempts = self.attempts.and_then(|i| text(i, "attempts"));
        let traceparent = self.traceparent.and_then(|i| text(i, "traceparent"));
        let tracestate = self.tracestate.and_then(|i| text(i, "tracestate"));
        let parsed_id = id.as_deref().and_then(|s| Uuid::parse_str(s).ok());
        let parsed_seq = seq.as_deref().and_then(|s| s.parse::<i64>().ok());
        let (Some(id), Some(seq)) = (parsed_id, parsed_seq) else {
            // Not a row the table can hold (id is the primary key, seq set by
            // its trigger): nothing to publish or to mark.
            return Inserted::NotFresh;
        };
        let data_len = data
            .as_ref()
            .map_or(0, |d| i64::try_from(d.len()).unwrap_or(i64::MAX));
        let data = data.filter(|d| d.len() <= max_payload);
        Inserted::Fresh(Box::new(ClaimedRow {
            id,
            seq,
            shard: shard.and_then(|s| s.parse().ok()).unwrap_or(0),
            retry: false,
            event_type,
            source,
            subject,
            time: time.as_deref().and_then(timestamp),
            created_at: created_at.as_deref().and_then(timestamp),
            attempts: attempts.and_then(|s| s.parse().ok()).unwrap_or(0),
            traceparent,
            tracestate,
            data,
            data_len,
            over_budget: false,
            blocker: None,
            decode_error: (!errors.is_empty()).then(|| errors.join("; ")),
            due_at: None,
            late_secs: None,
        }))
    }
}

/// A `timestamptz` in ISO text at UTC; `None` for `infinity`, BC dates and
/// years past 9999, as the claim makes them.
fn timestamp(s: &str) -> Option<DateTime<Utc>> {
    // The session pins `timezone = UTC`, so the text ends in `+00`: read as
    // RFC 3339 (a parser without a format string to interpret per value).
    if let Some(utc) = s.strip_suffix("+00")
        && utc.as_bytes().get(10) == Some(&b' ')
        && let Some(t) = rfc3339_at_utc(utc)
    {
        return Some(t);
    }
    DateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f%#z")
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// `YYYY-MM-DD hh:mm:ss[.ffffff]` at UTC read as RFC 3339 (`T` for the
/// space, `Z` after), in a buffer on the stack: one per row, no allocation
/// (the longest such text, with microseconds, is 26 bytes; a longer one is
/// left to the general parser).
fn rfc3339_at_utc(utc: &str) -> Option<DateTime<Utc>> {
    let mut buf = [0u8; 48];
    let bytes = utc.as_bytes();
    let end = bytes.len() + 1;
    buf.get_mut(..bytes.len())?.copy_from_slice(bytes);
    *buf.get_mut(10)? = b'T';
    *buf.get_mut(bytes.len())? = b'Z';
    let text = std::str::from_utf8(buf.get(..end)?).ok()?;
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation(columns: &[&str]) -> Relation {
        Relation {
            id: 1,
            namespace: "public".into(),
            name: "outbox_events".into(),
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
        }
    }

    const COLUMNS: &[&str] = &[
        "id",
        "event_type",
        "source",
        "subject",
        "time",
        "data",
        "created_at",
        "published_at",
        "attempts",
        "next_attempt_at",
        "traceparent",
        "seq",
        "shard",
    ];

    fn values(time: &str, published: Option<&str>) -> Vec<Value> {
        let t = |s: &str| Value::Text(s.to_owned());
        vec![
            t("0190f5c4-9a3e-7c3e-8a7b-2f1e4d5c6b7a"),
            t("invoice.created"),
            t("billing"),
            t("acct-1"),
            t(time),
            t("{\"amount\": 5}"),
            t("2026-12-02 16:07:46.5+00"),
            published.map_or(Value::Null, t),
            t("0"),
            Value::Null,
            Value::Null,
            t("42"),
            t("17"),
        ]
    }

    #[test]
    fn an_insert_becomes_the_row_a_claim_reads() {
        let layout = Layout::of(&relation(COLUMNS)).unwrap();
        let Inserted::Fresh(row) =
            layout.row(values("2026-12-02 16:07:46.123456+00", None), 1 << 20)
        else {
            panic!("not fresh")
        };
        assert_eq!(row.seq, 42);
        assert_eq!(row.shard, 17);
        assert_eq!(row.subject, "acct-1");
        assert_eq!(row.data.as_deref(), Some("{\"amount\": 5}"));
        assert_eq!(
            row.time.map(|t| t.to_rfc3339()),
            Some("2026-12-02T16:07:46.123456+00:00".to_owned())
        );
        assert!(row.decode_error.is_none());
    }

    #[test]
    fn times_no_client_can_carry_become_none_and_big_data_is_not_kept() {
        let layout = Layout::of(&relation(COLUMNS)).unwrap();
        for time in [
            "infinity",
            "-infinity",
            "0044-03-15 00:00:00+00 BC",
            "12000-01-01 00:00:00+00",
        ] {
            let Inserted::Fresh(row) = layout.row(values(time, None), 1 << 20) else {
                panic!("not fresh")
            };
            assert_eq!(row.time, None, "{time}");
        }
        let Inserted::Fresh(row) = layout.row(values("2026-01-01 00:00:00+00", None), 4) else {
            panic!("not fresh")
        };
        assert_eq!((row.data, row.data_len), (None, 13));
    }

    #[test]
    fn timestamps_read_as_the_claim_reads_them() {
        for (text, rfc3339) in [
            (
                "2026-12-02 16:07:46.123456+00",
                Some("2026-12-02T16:07:46.123456+00:00"),
            ),
            ("2026-12-02 16:07:46+00", Some("2026-12-02T16:07:46+00:00")),
            ("0001-01-01 00:00:00+00", Some("0001-01-01T00:00:00+00:00")),
            (
                "9999-12-31 23:59:59.999999+00",
                Some("9999-12-31T23:59:59.999999+00:00"),
            ),
            // Not what a UTC session sends, read all the same.
            (
                "2026-12-02 21:37:46.5+05:30",
                Some("2026-12-02T16:07:46.500+00:00"),
            ),
            ("infinity", None),
            ("0044-03-15 00:00:00+00 BC", None),
            ("12000-01-01 00:00:00+00", None),
            ("2026-12-02T16:07:46+00", None),
        ] {
            let read = timestamp(text).map(|t| t.to_rfc3339());
            assert_eq!(read.as_deref(), rfc3339, "{text}");
        }
    }

    #[test]
    fn rows_inserted_published_are_not_fresh_and_missing_columns_are_named() {
        let layout = Layout::of(&relation(COLUMNS)).unwrap();
        assert!(matches!(
            layout.row(
                values("2026-01-01 00:00:00+00", Some("2026-01-01 00:00:00+00")),
                1 << 20
            ),
            Inserted::NotFresh
        ));
        let err = Layout::of(&relation(&["id", "data"])).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("`seq`"), "{err}");
    }
}

/// Property tests: any relation and any tuple make a layout or an error and
/// a row or none, and any text a time or none, never a panic.
#[cfg(test)]
mod proptests {
    use chrono::{Datelike, TimeZone, Timelike};
    use proptest::prelude::*;

    use super::*;

    fn config() -> ProptestConfig {
        ProptestConfig {
            failure_persistence: None,
            ..ProptestConfig::with_cases(512)
        }
    }

    const COLUMNS: &[&str] = &[
        "id",
        "seq",
        "shard",
        "event_type",
        "source",
        "subject",
        "time",
        "data",
        "created_at",
        "attempts",
        "traceparent",
        "tracestate",
        "published_at",
        "next_attempt_at",
    ];

    /// Text near what a UTC session writes for a `timestamptz`, with any year,
    /// fraction and offset.
    const TIMESTAMPTZ: &str = "[+-]?[0-9]{1,6}-[0-9]{1,2}-[0-9]{1,2}[ T][0-9]{1,2}:[0-9]{1,2}:[0-9]{1,2}(\\.[0-9]{0,12})?([+-][0-9]{1,2}(:[0-9]{1,2}(:[0-9]{1,2})?)?)?( BC)?";

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            TIMESTAMPTZ,
            "-?[0-9]{1,25}",
            "[0-9a-fA-F-]{0,40}",
            Just("0190f5c4-9a3e-7c3e-8a7b-2f1e4d5c6b7a".to_owned()),
            Just("infinity".to_owned()),
        ]
    }

    fn value() -> impl Strategy<Value = Value> {
        prop_oneof![
            1 => Just(Value::Null),
            1 => Just(Value::Unchanged),
            1 => Just(Value::NotUtf8),
            1 => prop::collection::vec(any::<u8>(), 0..16).prop_map(Value::Binary),
            4 => text().prop_map(Value::Text),
        ]
    }

    /// Columns of `outbox_events`, most of them, with other names among
    /// them, in any order.
    fn relation() -> impl Strategy<Value = Relation> {
        (
            prop::collection::vec(prop::bool::weighted(0.9), COLUMNS.len()),
            prop::collection::vec(any::<String>(), 0..3),
        )
            .prop_flat_map(|(keep, other)| {
                let mut columns: Vec<String> = COLUMNS
                    .iter()
                    .zip(keep)
                    .filter(|(_, keep)| *keep)
                    .map(|(c, _)| (*c).to_owned())
                    .collect();
                columns.extend(other);
                Just(columns).prop_shuffle()
            })
            .prop_map(|columns| Relation {
                id: 1,
                namespace: "public".into(),
                name: "outbox_events".into(),
                columns,
            })
    }

    /// A tuple for `relation`: a value of its kind for each column it has,
    /// and now and then too few or too many.
    fn tuple(relation: &Relation) -> impl Strategy<Value = Vec<Value>> + use<> {
        let n = relation.columns.len();
        prop_oneof![
            4 => prop::collection::vec(value(), n),
            1 => prop::collection::vec(value(), 0..n + 4),
        ]
    }

    /// How a UTC session writes `t`: microseconds with trailing zeros cut.
    fn written(t: DateTime<Utc>) -> String {
        let mut s = t.format("%Y-%m-%d %H:%M:%S").to_string();
        let micros = t.nanosecond() / 1_000;
        if micros != 0 {
            s.push_str(format!(".{micros:06}").trim_end_matches('0'));
        }
        s.push_str("+00");
        s
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn any_text_is_a_time_or_none(s in prop_oneof![any::<String>(), TIMESTAMPTZ]) {
            let _ = timestamp(&s);
        }

        #[test]
        fn every_time_a_utc_session_writes_reads_back(
            micros in Utc.with_ymd_and_hms(1, 1, 1, 0, 0, 0).unwrap().timestamp_micros()
                ..=Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap().timestamp_micros() + 999_999,
        ) {
            let t = DateTime::from_timestamp_micros(micros).unwrap();
            prop_assert!((1..=9999).contains(&t.year()));
            prop_assert_eq!(timestamp(&written(t)), Some(t), "{}", written(t));
        }

        #[test]
        fn any_relation_and_tuple_make_a_row_or_none(
            (relation, values) in relation().prop_flat_map(|r| {
                let tuple = tuple(&r);
                (Just(r), tuple)
            }),
            max_payload in prop_oneof![0_usize..64, any::<usize>()],
        ) {
            let Ok(layout) = Layout::of(&relation) else {
                return Ok(());
            };
            let data = relation
                .columns
                .iter()
                .position(|c| c == "data")
                .and_then(|i| values.get(i).cloned());
            if let Inserted::Fresh(row) = layout.row(values, max_payload) {
                prop_assert!(row.data.as_ref().is_none_or(|d| d.len() <= max_payload));
                let len = match data {
                    Some(Value::Text(d)) => i64::try_from(d.len()).unwrap(),
                    _ => 0,
                };
                prop_assert_eq!(row.data_len, len);
                prop_assert!(row.decode_error.as_ref().is_none_or(|e| !e.is_empty()));
            }
        }
    }
}
