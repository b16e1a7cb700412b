//! `invoice.created`'s schema file is the one derived from [`InvoiceCreated`].
//! Rewrite it from the type with `UPDATE_SCHEMAS=1 cargo test -p example-billing --test schemas`.
//! (Billing's readers of `subscription.*` decode only the fields they use;
//! the producer's types are checked against those files.)

use example_billing::default_schemas_dir;
use example_billing::events::InvoiceCreated;
use outbox_pg::check_schema_file;

#[test]
fn invoice_created_matches_its_schema_file() {
    check_schema_file::<InvoiceCreated>(default_schemas_dir()).unwrap();
}
