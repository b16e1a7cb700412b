//! How a command's result is printed: as text for people, or as one JSON
//! document (`--json`) for programs.

use std::io::Write;

use serde::Serialize;

use crate::error::Result;

/// A command's result: serialized as it is for `--json`, rendered by
/// [`Report::human`] otherwise.
pub(crate) trait Report: Serialize {
    /// Writes the result for people.
    ///
    /// # Errors
    /// The writer's.
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()>;
}

/// Prints `report` on stdout as JSON (one document and a newline) or as text.
pub(crate) fn print(report: &impl Report, json: bool) -> Result<()> {
    match write(report, json) {
        // A reader that went away (`outboxctl status | head`) is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

fn write(report: &impl Report, json: bool) -> std::io::Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if json {
        serde_json::to_writer_pretty(&mut out, report).map_err(std::io::Error::from)?;
        writeln!(out)?;
    } else {
        report.human(&mut out)?;
    }
    out.flush()?;
    Ok(())
}

/// A duration in seconds as people read it: `3d 4h`, `12m 5s`, `0.4s`.
pub(crate) fn age(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "-".to_owned();
    }
    if seconds < 10.0 {
        return format!("{seconds:.1}s");
    }
    // Whole seconds from here: the fraction says nothing at this scale.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let s = seconds as u64;
    let (d, h, m, s) = (s / 86_400, s / 3_600 % 24, s / 60 % 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

/// A timestamp for a table cell.
pub(crate) fn when(at: Option<chrono::DateTime<chrono::Utc>>) -> String {
    at.map_or_else(
        || "-".to_owned(),
        |at| at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    )
}

/// Rows of cells as aligned columns, the first row a header: two spaces
/// between columns, no borders, no trailing blanks, never wrapped.
pub(crate) fn table(out: &mut dyn Write, rows: &[Vec<String>]) -> std::io::Result<()> {
    let mut table = comfy_table::Table::new();
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_content_arrangement(comfy_table::ContentArrangement::Disabled);
    for (i, row) in rows.iter().enumerate() {
        if i == 0 {
            table.set_header(row);
        } else {
            table.add_row(row);
        }
    }
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
    }
    for line in table.lines() {
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_at_their_scale() {
        assert_eq!(age(0.42), "0.4s");
        assert_eq!(age(59.0), "59s");
        assert_eq!(age(125.0), "2m 5s");
        assert_eq!(age(3.0 * 3600.0 + 60.0), "3h 1m");
        assert_eq!(age(2.0 * 86_400.0 + 7200.0), "2d 2h");
        assert_eq!(age(f64::NAN), "-");
    }

    #[test]
    fn tables_align_their_columns() {
        let mut out = Vec::new();
        table(
            &mut out,
            &[
                vec!["type".into(), "rows".into()],
                vec!["invoice.raised".into(), "3".into()],
            ],
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "type            rows\ninvoice.raised  3\n"
        );
    }
}
