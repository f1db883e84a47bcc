//! TCP's sequence numbers in a flow's entries: netfilter's window tracking,
//! as far as the states and timeouts need it (see [`super::NatEntry`]).

use super::{NatEntry, SEEN_ACK, SEEN_RST};

/// [`NatEntry::seq_end`] holds this direction's own value (not set: an
/// entry made before sequence tracking, by a take-over, or by the other
/// direction and not yet sent on).
pub const TCP_END_KNOWN: u8 = 0x01;
/// [`NatEntry::ack`] holds this direction's own value.
pub const TCP_ACK_KNOWN: u8 = 0x02;
/// This direction's last segment advertised a zero window.
pub const TCP_ZERO_WINDOW: u8 = 0x04;
/// This direction owes the other an acknowledgement of its FIN: set by a
/// take-over of conntrack's `FIN_WAIT` or `LAST_ACK` (conntrack does not say
/// the sequence numbers), cleared by this direction's next ACK, as
/// conntrack's next ACK moves those states on.
pub const TCP_OWES_FIN_ACK: u8 = 0x08;

/// Whether sequence number `a` comes after `b` (RFC 1982 arithmetic).
#[must_use]
pub const fn seq_after(a: u32, b: u32) -> bool {
    a.wrapping_sub(b).cast_signed() > 0
}

/// What a TCP segment tells its direction's entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    /// Its sequence number plus its payload's length, plus one for SYN and
    /// one for FIN (host order).
    pub end: u32,
    /// Its acknowledgement number (host order).
    pub ack: u32,
    /// The TCP header's flags (the `SEEN_*` bits are the same).
    pub flags: u8,
    /// Whether it carries sequence space (data, SYN or FIN).
    pub carries_seq: bool,
    /// Whether it advertises a zero window.
    pub zero_window: bool,
}

impl NatEntry {
    /// Records a TCP segment this entry's direction sent, as netfilter's
    /// window tracking does for the timeouts. Writes a field only when it
    /// changes: most segments of a bulk transfer advance `seq_end` or
    /// `ack` and nothing else.
    // Inlined into the programs as when they were the eBPF crate's own.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub fn track_segment(&mut self, seg: &Segment) {
        let old = self.tcp;
        let mut tcp = old;
        if tcp & TCP_END_KNOWN == 0 || seq_after(seg.end, self.seq_end) {
            self.seq_end = seg.end;
            tcp |= TCP_END_KNOWN;
            if self.retrans != 0 {
                self.retrans = 0;
            }
        } else if seg.carries_seq && self.retrans != u8::MAX {
            // Sequence space sent again.
            self.retrans += 1;
        }
        if seg.flags & SEEN_ACK != 0 {
            if tcp & TCP_ACK_KNOWN == 0 || seq_after(seg.ack, self.ack) {
                self.ack = seg.ack;
            }
            tcp = (tcp | TCP_ACK_KNOWN) & !TCP_OWES_FIN_ACK;
        }
        // A reset's window means nothing.
        if seg.flags & SEEN_RST == 0 {
            tcp = if seg.zero_window {
                tcp | TCP_ZERO_WINDOW
            } else {
                tcp & !TCP_ZERO_WINDOW
            };
        }
        if tcp != old {
            self.tcp = tcp;
        }
    }

    /// Starts this direction's sequence tracking afresh (the tuple opens
    /// a new connection).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub fn forget_segments(&mut self) {
        // The numbers stay as they are, unknown without their bits.
        self.tcp = 0;
        self.retrans = 0;
    }
}
