-- Whether the previous leader let go cleanly; no row: there was none on record.
select released from inbox_leases where consumer = $1
