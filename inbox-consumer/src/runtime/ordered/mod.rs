//! Ordered consumption ([`ConsumerConfig::ordered`](super::ConsumerConfig::ordered)):
//! what only a consumer with one leader across its replicas needs, beside the
//! session every mode shares. See the [runtime docs](super#ordered-consumption)
//! for the guarantee and its cost.
//!
//! - [`lease`]: who leads (a session-level advisory lock), the epoch that
//!   fences a deposed leader's commits, and the keeper that steps down when
//!   the lead cannot be confirmed;
//! - [`lock_holder`]: who holds the leader lock when a standby has waited
//!   for it longer than a lease;
//! - [`takeover`]: a new leader's scan for the events earlier leaders left
//!   unfinished, and the [`Backlog`](takeover::Backlog) holding later events
//!   of their subjects back behind them;
//! - [`checkpoint`]: the stream sequence a leader records so that the next
//!   one's scan starts there rather than at the ack floor;
//! - [`gaps`]: deliveries a leader never received (a jump in its consumer
//!   sequence), read by sequence before the messages held behind them go on.
//!
//! The runtime drives them: it leads ([`Consumer`](super::Consumer)'s
//! leader loop, in the [parent module](super)), and its session holds back,
//! checkpoints and fills gaps with them. Nothing here is used by an
//! unordered consumer.

pub(super) mod checkpoint;
pub(super) mod gaps;
pub(super) mod lease;
pub(super) mod lock_holder;
pub(super) mod takeover;
