//! Rewriting a packet as the programs do: checksums recomputed over whole
//! regions, then moved.

use vpcnet_common::{
    counters::Counter,
    nat::{PROTO_ICMP, PROTO_TCP, PROTO_UDP},
};

use super::{IP, Ip, Run};

/// Sum of 16-bit big-endian words, folded, of `bytes` (an odd last byte
/// padded with zero, as the Internet checksum pads it).
pub(super) fn ones_sum(bytes: &[u8]) -> u32 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum
}

/// A checksum over a region whose words summed to `old` now summing to
/// `new`: what it becomes (RFC 1624: the checksum is the complement of the
/// sum, which moves by the difference).
pub(super) fn moved(csum: u16, old: u32, new: u32) -> u16 {
    let mut sum = u32::from(!csum) + (0xffff - old) + new;
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap_or(u16::MAX)
}

/// [`ones_sum`] of `bytes` with the 16-bit word at `skip` counted as zero.
pub(super) fn ones_sum_without(bytes: &[u8], skip: usize) -> u32 {
    let mut copy = bytes.to_vec();
    if let Some(word) = copy.get_mut(skip..skip + 2) {
        word.fill(0);
    }
    ones_sum(&copy)
}

impl Run<'_> {
    pub(super) fn count(&mut self, counter: Counter) {
        self.counted.push(counter);
    }

    pub(super) fn csum_at(&self, off: usize) -> u16 {
        u16::from_be_bytes([self.p[off], self.p[off + 1]])
    }

    pub(super) fn put_csum(&mut self, off: usize, value: u16) {
        self.p[off..off + 2].copy_from_slice(&value.to_be_bytes());
        if !self.checksums.contains(&off) {
            self.checksums.push(off);
        }
    }

    /// Writes `new` at `off`, moving the checksum of the IP header at
    /// `ip_off` when the field is in it, and the L4 checksum at `l4_csum`
    /// (`udp`: zero means none and is never produced).
    pub(super) fn write(
        &mut self,
        off: usize,
        new: &[u8],
        ip_off: Option<usize>,
        l4_csum: Option<(usize, bool)>,
    ) {
        let old_bytes = self.p[off..off + new.len()].to_vec();
        if old_bytes == new {
            return;
        }
        let (old, now) = (ones_sum(&old_bytes), ones_sum(new));
        self.p[off..off + new.len()].copy_from_slice(new);
        if let Some(ip) = ip_off {
            let c = self.csum_at(ip + 10);
            self.put_csum(ip + 10, moved(c, old, now));
        }
        if let Some((at, udp)) = l4_csum {
            let c = self.csum_at(at);
            if !udp {
                self.put_csum(at, moved(c, old, now));
            } else if c != 0 {
                // UDP's zero means "none": never produced, and compared
                // exactly, so not among `checksums`.
                let value = match moved(c, old, now) {
                    0 => 0xffff,
                    v => v,
                };
                self.p[at..at + 2].copy_from_slice(&value.to_be_bytes());
            }
        }
    }

    /// The L4 checksum a rewrite of `ip`'s addresses or ports moves.
    pub(super) fn l4_csum(ip: &Ip) -> Option<(usize, bool)> {
        match ip.proto {
            PROTO_TCP => Some((ip.l4 + 16, false)),
            PROTO_UDP => Some((ip.l4 + 6, true)),
            PROTO_ICMP => Some((ip.l4 + 2, false)),
            _ => None,
        }
    }

    /// Whether the TCP or UDP checksum of `ip` lies past the packet's end
    /// (a first fragment cut short): the program cannot move it.
    pub(super) fn l4_csum_cut(&self, ip: &Ip) -> bool {
        matches!(ip.proto, PROTO_TCP | PROTO_UDP)
            && Self::l4_csum(ip).is_some_and(|(at, _)| at + 2 > self.p.len())
    }

    /// Rewrites the source (`source`) or destination address of the outer
    /// header; `with_l4`: TCP and UDP checksums cover it.
    pub(super) fn set_addr(&mut self, ip: &Ip, source: bool, new: u32, with_l4: bool) {
        let off = ip.off + if source { 12 } else { 16 };
        let l4 = match ip.proto {
            PROTO_TCP | PROTO_UDP if with_l4 => Self::l4_csum(ip),
            _ => None,
        };
        self.write(off, &new.to_ne_bytes(), Some(ip.off), l4);
    }

    pub(super) fn set_port(&mut self, ip: &Ip, off: usize, new: u16) {
        self.write(off, &new.to_ne_bytes(), None, Self::l4_csum(ip));
    }

    pub(super) fn ttl(&self) -> u8 {
        self.p[IP + 8]
    }
}
