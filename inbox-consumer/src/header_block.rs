//! A NATS header block as a stream stores it, read without trusting it.
//!
//! Any client allowed to publish on a subject can write any bytes into a
//! message's header block (client libraries tidy header values; the server
//! does not). The NATS client this crate runs on (async-nats) reads each
//! message it receives with strict rules and, on a block it cannot read,
//! drops the whole connection and never hands the message over. So the
//! runtime reads such a message back by its stream sequence (JetStream's
//! message-get API answers in JSON, the header block base64-encoded) and
//! judges the block here, with the client's own rules:
//!
//! - the block is UTF-8;
//! - its first line is `NATS/1.0` with nothing after it: a status code there
//!   (`NATS/1.0 503`) makes the client take the message for a status of its
//!   own (or refuse it, if the code does not parse), never for a message;
//! - every other line, split on LF (a CR before the LF dropped), is empty, a
//!   continuation (it starts with white space), or `name: value`, with a
//!   name of visible ASCII characters other than `:`.
//!
//! [`read`] never panics, whatever the bytes (a property test holds it to
//! that); it returns the lines it could read beside the first problem the
//! client would stop at, so a dead letter keeps what is legible.

use std::fmt;

/// What [`read`] found: the `name: value` pairs it could read, in order, and
/// the first reason the client cannot read the block, if any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HeaderBlock {
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) problem: Option<Problem>,
}

/// Why the client cannot read a header block. Lines count from 1, the
/// version line included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Problem {
    /// The block holds bytes that are not UTF-8 (first at this byte offset).
    NotUtf8 { offset: usize },
    /// The block is empty or does not start with `NATS/1.0`.
    NoVersionLine,
    /// The version line carries a status (`NATS/1.0 503 …`).
    Status { line: String },
    /// A line that is neither empty, a continuation, nor `name: value`.
    NoColon { line: usize },
    /// A header name with a character other than visible ASCII (or `:`).
    BadName { line: usize },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotUtf8 { offset } => {
                write!(f, "the header block is not UTF-8 (at byte {offset})")
            }
            Self::NoVersionLine => f.write_str("the header block does not start with NATS/1.0"),
            Self::Status { line } => write!(
                f,
                "the header block's version line carries a status (`{}`)",
                line.escape_debug()
            ),
            Self::NoColon { line } => write!(
                f,
                "header line {line} is not `name: value` (no colon; a bare LF in a value splits a line too)"
            ),
            Self::BadName { line } => write!(
                f,
                "header line {line} has a name with a character that is not visible ASCII"
            ),
        }
    }
}

impl HeaderBlock {
    /// Whether the client reads this block (and so hands the message over).
    pub(crate) fn readable(&self) -> bool {
        self.problem.is_none()
    }
}

/// Reads `block` as the client would; see the [module docs](self).
pub(crate) fn read(block: &[u8]) -> HeaderBlock {
    let text = match std::str::from_utf8(block) {
        Ok(text) => text,
        Err(e) => {
            // What can be read is read from the valid prefix.
            let valid = e.valid_up_to();
            let prefix = String::from_utf8_lossy(block.get(..valid).unwrap_or_default());
            let mut partial = read_text(&prefix);
            partial.problem = Some(Problem::NotUtf8 { offset: valid });
            return partial;
        }
    };
    read_text(text)
}

fn read_text(text: &str) -> HeaderBlock {
    let mut block = HeaderBlock::default();
    let mut lines = text.lines().enumerate().peekable();
    let Some((_, version)) = lines.next() else {
        block.problem = Some(Problem::NoVersionLine);
        return block;
    };
    match version.strip_prefix("NATS/1.0") {
        None => note(&mut block, Problem::NoVersionLine),
        Some(rest) if !rest.trim().is_empty() => note(
            &mut block,
            Problem::Status {
                line: version.chars().take(64).collect(),
            },
        ),
        Some(_) => {}
    }
    while let Some((index, line)) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let number = index + 1;
        let Some((name, value)) = line.split_once(':') else {
            note(&mut block, Problem::NoColon { line: number });
            continue;
        };
        if name.contains(|c: char| !c.is_ascii_graphic() || c == ':') {
            note(&mut block, Problem::BadName { line: number });
        }
        let mut value = value.trim_start().to_owned();
        while let Some((_, more)) = lines.next_if(|(_, l)| l.starts_with(char::is_whitespace)) {
            value.push_str(more);
        }
        value.truncate(value.trim_end().len());
        block.headers.push((name.to_owned(), value));
    }
    block
}

/// Keeps the first problem.
fn note(block: &mut HeaderBlock, problem: Problem) {
    block.problem.get_or_insert(problem);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

    use super::*;

    fn problem(block: &[u8]) -> Option<Problem> {
        read(block).problem
    }

    #[test]
    fn a_block_the_client_reads_is_readable_with_its_headers() {
        let block = read(b"NATS/1.0\r\nNats-Msg-Id: abc\r\nX-Two: a\r\n  b\r\nX-Two: c\r\n\r\n");
        assert!(block.readable(), "{block:?}");
        assert_eq!(
            block.headers,
            [
                ("Nats-Msg-Id".to_owned(), "abc".to_owned()),
                ("X-Two".to_owned(), "a  b".to_owned()),
                ("X-Two".to_owned(), "c".to_owned()),
            ]
        );
        // A bare CR in a value: the client reads it (as a space).
        assert!(read(b"NATS/1.0\r\nX-Note: a\rb\r\n\r\n").readable());
        // NUL in a value: read.
        assert!(read(b"NATS/1.0\r\nX-Note: a\0b\r\n\r\n").readable());
    }

    #[test]
    fn each_block_the_client_refuses_is_named() {
        assert_eq!(
            problem(b"NATS/1.0\r\nX-Note: a\nb\r\n\r\n"),
            Some(Problem::NoColon { line: 3 })
        );
        assert_eq!(
            problem(b"NATS/1.0\r\nX-Note: \xff\xfe\r\n\r\n"),
            Some(Problem::NotUtf8 { offset: 18 })
        );
        assert_eq!(
            problem(b"NATS/1.0\r\nX-\xffNote: v\r\n\r\n"),
            Some(Problem::NotUtf8 { offset: 12 })
        );
        assert_eq!(
            problem(b"NATS/1.0\r\nno colon here\r\n\r\n"),
            Some(Problem::NoColon { line: 2 })
        );
        assert_eq!(
            problem(b"NATS/1.0\r\nX Note: v\r\n\r\n"),
            Some(Problem::BadName { line: 2 })
        );
        assert!(matches!(
            problem(b"NATS/1.0 503\r\n\r\n"),
            Some(Problem::Status { .. })
        ));
        assert_eq!(problem(b""), Some(Problem::NoVersionLine));
        assert_eq!(
            problem(b"HTTP/1.1\r\nX: y\r\n\r\n"),
            Some(Problem::NoVersionLine)
        );
    }

    #[test]
    fn what_is_legible_is_kept_beside_the_problem() {
        let block = read(b"NATS/1.0\r\nNats-Msg-Id: abc\r\nbroken\r\nX-After: 1\r\n\r\n");
        assert_eq!(block.problem, Some(Problem::NoColon { line: 3 }));
        assert_eq!(
            block.headers,
            [
                ("Nats-Msg-Id".to_owned(), "abc".to_owned()),
                ("X-After".to_owned(), "1".to_owned()),
            ]
        );
        let block = read(b"NATS/1.0\r\nNats-Msg-Id: abc\r\nX: \xff\r\n");
        assert_eq!(
            block.headers[0],
            ("Nats-Msg-Id".to_owned(), "abc".to_owned())
        );
        assert!(matches!(block.problem, Some(Problem::NotUtf8 { .. })));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]

        #[test]
        fn any_bytes_give_a_value_never_a_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let block = read(&bytes);
            let _ = block.problem.map(|p| p.to_string());
        }

        #[test]
        fn any_lines_after_the_version_give_a_value_never_a_panic(
            lines in proptest::collection::vec("[ -~\t\r\n\u{0}\u{80}-\u{10ffff}]{0,40}", 0..12),
        ) {
            let block = format!("NATS/1.0\r\n{}\r\n\r\n", lines.join("\r\n"));
            let read = read(block.as_bytes());
            // Whatever it says, a readable block's headers are all it read.
            if read.readable() {
                proptest::prop_assert!(read.headers.iter().all(|(name, _)| !name.contains(':')));
            }
        }
    }
}
