-- The service's first table, from before it adopted the outbox.
create table customers (
  id   text primary key,
  name text not null
);
