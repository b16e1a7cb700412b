-- Removes the dead row versions and index entries that marking leaves behind.
-- TRUNCATE false: never take the exclusive lock that truncating the file needs.
-- SKIP_LOCKED: if another vacuum holds the table, skip instead of waiting.
vacuum (skip_locked, truncate false) outbox_events
