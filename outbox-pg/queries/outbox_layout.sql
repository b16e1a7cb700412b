-- What a relay needs of the outbox's schema, as the search_path finds it:
-- the table, the columns it reads and writes, the two triggers (the seq, the
-- wake-up) enabled, and the seq sequence's settings. Read-only; catalogs only.
--   $1 columns; $2 triggers
select to_regclass('outbox_events') is not null as "table!",
       coalesce((select array_agg(c order by c)
                   from unnest($1::text[]) as c
                  where not exists (select 1 from pg_attribute a
                                     where a.attrelid = to_regclass('outbox_events')
                                       and a.attname = c and not a.attisdropped)), '{}') as "missing_columns!",
       coalesce((select array_agg(t order by t)
                   from unnest($2::text[]) as t
                  where not exists (select 1 from pg_trigger g
                                     where g.tgrelid = to_regclass('outbox_events')
                                       and g.tgname = t and g.tgenabled <> 'D')), '{}') as "missing_triggers!",
       to_regclass('outbox_events_seq') is not null as "sequence!",
       s.seqcache as "seq_cache?",
       s.seqcycle as "seq_cycle?",
       s.seqincrement as "seq_increment?"
  from (select 1) as one
  left join pg_sequence s on s.seqrelid = to_regclass('outbox_events_seq')
