-- Whether the previous leader let go cleanly; no row: there was none.
select released from inbox_leases where consumer = $1
