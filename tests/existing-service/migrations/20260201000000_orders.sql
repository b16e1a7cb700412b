-- A later table: its version sorts after the outbox's 20260101… files, so a
-- migrations folder holding both runs them interleaved.
create table orders (
  id          text   primary key,
  customer_id text   not null references customers (id),
  amount      bigint not null
);
