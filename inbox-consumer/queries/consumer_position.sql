-- Where a consumer stood on its stream; no row: never run against this inbox.
select stream, filter_subjects, ack_floor from inbox_consumers where consumer = $1
