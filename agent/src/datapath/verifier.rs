//! What each program costs the kernel's verifier, against its limits: the
//! instructions it processed (the kernel's own count) and the stack of its
//! deepest call chain.
//!
//! The kernel only reports stack depths in the log of a load, which aya
//! keeps only when the load fails, so the stack is worked out here from
//! the object the way the verifier does it: the subprograms are the
//! targets of bpf-to-bpf calls and of callback references (`bpf_loop`);
//! a subprogram's depth is the deepest offset below r10 it addresses; the
//! combined depth is the sum of rounded frames along the deepest chain.
//! The rounding is where kernels differ: before 6.9 every frame counts as
//! at least 32 bytes, rounded up to 32 (`round_up(max(depth, 1), 32)`);
//! from 6.9 a frame of a JIT-compiled program is rounded up to 16. A chain of several frames
//! can thus fit 512 bytes on 6.18 and not on 6.1.

use std::{collections::BTreeMap, fmt, time::Duration};

use aya_obj::{Object, generated::bpf_insn};

/// The kernel's limit on a call chain's combined stack (`MAX_BPF_STACK`).
pub const MAX_STACK: u32 = 512;
/// Kept free below [`MAX_STACK`] under the pre-6.9 rounding, so that the
/// next feature has room before 6.1 refuses a program.
pub const STACK_BUDGET: u32 = 448;
/// The verifier's limit on processed instructions
/// (`BPF_COMPLEXITY_LIMIT_INSNS`).
pub const INSN_LIMIT: u32 = 1_000_000;
/// Processed instructions a program may use: half the limit, so that a
/// kernel whose verifier explores more states still loads it.
pub const INSN_BUDGET: u32 = INSN_LIMIT / 2;

/// How a kernel rounds each frame of a call chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameRounding {
    /// Before 6.9: `round_up(max(depth, 1), 32)`, the interpreter's
    /// granularity, even for a frame with no stack.
    Before6_9,
    /// From 6.9, JIT-compiled programs: `round_up(depth, 16)`.
    Jit16,
}

impl FrameRounding {
    /// The rounding of the running kernel (`uname` release `major.minor...`).
    pub fn of_release(release: &str) -> Self {
        let mut parts = release.split(|c: char| !c.is_ascii_digit());
        let major: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        let minor: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        if (major, minor) >= (6, 9) {
            Self::Jit16
        } else {
            Self::Before6_9
        }
    }

    pub fn frame(self, depth: u32) -> u32 {
        match self {
            Self::Before6_9 => depth.max(1).next_multiple_of(32),
            Self::Jit16 => depth.next_multiple_of(16),
        }
    }
}

/// One frame of a call chain: the subprogram and its own stack depth.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub function: String,
    pub depth: u32,
}

/// A program's deepest call chain, the program's own frame first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackUse {
    pub chain: Vec<Frame>,
}

impl StackUse {
    /// The chain's combined stack under `rounding`.
    pub fn combined(&self, rounding: FrameRounding) -> u32 {
        self.chain.iter().map(|f| rounding.frame(f.depth)).sum()
    }
}

impl fmt::Display for StackUse {
    /// `pod_egress 360 + claim_step 128 + memset 0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, frame) in self.chain.iter().enumerate() {
            if i > 0 {
                f.write_str(" + ")?;
            }
            write!(f, "{} {}", frame.function, frame.depth)?;
        }
        Ok(())
    }
}

/// The object could not be read as the loader reads it.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("parsing the eBPF object")]
    Parse(#[from] aya_obj::ParseError),
    #[error("linking the eBPF object's calls")]
    Link(#[from] aya_obj::relocation::EbpfRelocationError),
    #[error("program {program}: a call chain longer than the kernel's 8 frames")]
    TooDeep { program: String },
}

/// The deepest call chain of every program in `object`, by program name.
pub fn stack_use(object: &[u8]) -> Result<BTreeMap<String, StackUse>, StackError> {
    let mut obj = Object::parse(object)?;
    let text_sections = obj.functions.keys().map(|(section, _)| *section).collect();
    let originals: Vec<(String, Vec<bpf_insn>)> = obj
        .functions
        .values()
        .map(|f| (f.name.clone(), f.instructions.clone()))
        .collect();
    // Calls are linked as the loader links them: every callee appended to
    // the program's instructions, calls made pc-relative.
    obj.relocate_calls(&text_sections)?;
    let mut uses = BTreeMap::new();
    for (name, program) in &obj.programs {
        let Some(function) = obj.functions.get(&program.function_key()) else {
            continue;
        };
        let linked = Linked::new(&function.instructions);
        let chain = linked
            .deepest_chain(0, 0)
            .ok_or_else(|| StackError::TooDeep {
                program: name.clone(),
            })?
            .into_iter()
            .map(|sub| Frame {
                function: if sub == 0 {
                    name.clone()
                } else {
                    linked.name_of(sub, &originals)
                },
                depth: linked.subprogs[sub].depth,
            })
            .collect();
        uses.insert(name.clone(), StackUse { chain });
    }
    Ok(uses)
}

const BPF_CLASS_MASK: u8 = 0x07;
const BPF_LD: u8 = 0x00;
const BPF_LDX: u8 = 0x01;
const BPF_ST: u8 = 0x02;
const BPF_STX: u8 = 0x03;
const BPF_ALU: u8 = 0x04;
const BPF_JMP: u8 = 0x05;
const BPF_ALU64: u8 = 0x07;
const BPF_MODE_MASK: u8 = 0xe0;
const BPF_MEM: u8 = 0x60;
const BPF_ATOMIC: u8 = 0xc0;
const BPF_OP_MASK: u8 = 0xf0;
const BPF_SRC_X: u8 = 0x08;
const BPF_ADD: u8 = 0x00;
const BPF_SUB: u8 = 0x10;
const BPF_MOV: u8 = 0xb0;
const BPF_CALL: u8 = 0x80;
const LD_IMM64: u8 = 0x18;
const BPF_PSEUDO_CALL: u8 = 1;
const BPF_PSEUDO_FUNC: u8 = 4;
/// The frame pointer.
const R10: u8 = 10;
/// The kernel's limit on nested frames (`MAX_CALL_FRAMES`).
const MAX_CALL_FRAMES: usize = 8;

/// A subprogram of a linked program.
#[derive(Debug)]
struct Subprog {
    start: usize,
    end: usize,
    depth: u32,
    callees: Vec<usize>,
}

/// A program's instructions, split into subprograms.
struct Linked<'a> {
    insns: &'a [bpf_insn],
    subprogs: Vec<Subprog>,
}

impl<'a> Linked<'a> {
    fn new(insns: &'a [bpf_insn]) -> Self {
        let mut starts = vec![0];
        let mut i = 0;
        while i < insns.len() {
            if let Some(target) = call_target(insns, i) {
                starts.push(target);
            }
            i += if insns[i].code == LD_IMM64 { 2 } else { 1 };
        }
        starts.sort_unstable();
        starts.dedup();
        let mut subprogs: Vec<Subprog> = starts
            .iter()
            .enumerate()
            .map(|(n, &start)| {
                let end = starts.get(n + 1).copied().unwrap_or(insns.len());
                Subprog {
                    start,
                    end,
                    depth: frame_depth(&insns[start..end]),
                    callees: Vec::new(),
                }
            })
            .collect();
        for sub in &mut subprogs {
            let mut i = sub.start;
            while i < sub.end {
                if let Some(target) = call_target(insns, i)
                    && let Ok(callee) = starts.binary_search(&target)
                {
                    sub.callees.push(callee);
                }
                i += if insns[i].code == LD_IMM64 { 2 } else { 1 };
            }
        }
        Self { insns, subprogs }
    }

    /// The chain below `sub` whose pre-6.9 combined stack is the largest
    /// (the rounding that bites first), `sub` first; `None` past the
    /// kernel's frame limit.
    fn deepest_chain(&self, sub: usize, level: usize) -> Option<Vec<usize>> {
        if level >= MAX_CALL_FRAMES {
            return None;
        }
        let mut best: Vec<usize> = Vec::new();
        let mut best_depth = 0;
        for &callee in &self.subprogs[sub].callees {
            let chain = self.deepest_chain(callee, level + 1)?;
            let depth: u32 = chain
                .iter()
                .map(|&s| FrameRounding::Before6_9.frame(self.subprogs[s].depth))
                .sum();
            if depth > best_depth {
                best = chain;
                best_depth = depth;
            }
        }
        let mut chain = vec![sub];
        chain.extend(best);
        Some(chain)
    }

    /// The name of the object's function whose code subprogram `sub` is:
    /// the same instructions but for the call offsets linking rewrote.
    fn name_of(&self, sub: usize, originals: &[(String, Vec<bpf_insn>)]) -> String {
        let code = &self.insns[self.subprogs[sub].start..self.subprogs[sub].end];
        originals
            .iter()
            .find(|(_, insns)| {
                insns.len() == code.len()
                    && insns.iter().zip(code).all(|(a, b)| {
                        a.code == b.code
                            && a.dst_reg() == b.dst_reg()
                            && a.off == b.off
                            && (a.imm == b.imm || a.code == LD_IMM64 || is_call(*a))
                    })
            })
            .map_or_else(
                || format!("subprog@{}", self.subprogs[sub].start),
                |(name, _)| readable_name(name).to_owned(),
            )
    }
}

/// A Rust symbol's last path segment: `claim_step` for the v0-mangled
/// `_RNvNtCs6g7wvZ8y74k_6vpcnet3nat10claim_step`, which ends in the
/// identifier's length and the identifier. Other names stay as they are.
fn readable_name(symbol: &str) -> &str {
    if !symbol.starts_with("_R") {
        return symbol;
    }
    for len in 1..symbol.len() {
        let (head, ident) = symbol.split_at(symbol.len() - len);
        let digits = head.len() - head.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0 && head[head.len() - digits..].parse() == Ok(len) {
            return ident;
        }
    }
    symbol
}

fn is_call(insn: bpf_insn) -> bool {
    insn.code == BPF_JMP | BPF_CALL
}

/// The instruction a bpf-to-bpf call or a callback reference at `i`
/// points to.
fn call_target(insns: &[bpf_insn], i: usize) -> Option<usize> {
    let insn = &insns[i];
    let pseudo = (is_call(*insn) && insn.src_reg() == BPF_PSEUDO_CALL)
        || (insn.code == LD_IMM64 && insn.src_reg() == BPF_PSEUDO_FUNC);
    if !pseudo {
        return None;
    }
    let target = i64::try_from(i).ok()? + i64::from(insn.imm) + 1;
    usize::try_from(target).ok().filter(|&t| t < insns.len())
}

/// The deepest byte below r10 that `code` addresses: through r10 itself,
/// or through a register holding r10 plus a constant (a pointer handed to
/// a helper or a callee counts where it is made, as the verifier charges
/// accesses through it to this frame).
fn frame_depth(code: &[bpf_insn]) -> u32 {
    let mut frame_ptr: [Option<i64>; 11] = [None; 11];
    frame_ptr[usize::from(R10)] = Some(0);
    let mut deepest: i64 = 0;
    let mut note = |offset: i64| deepest = deepest.max(-offset);
    let mut i = 0;
    while i < code.len() {
        let insn = &code[i];
        let dst = usize::from(insn.dst_reg()).min(10);
        let src = usize::from(insn.src_reg()).min(10);
        let class = insn.code & BPF_CLASS_MASK;
        let mode = insn.code & BPF_MODE_MASK;
        match class {
            BPF_LDX if mode == BPF_MEM => {
                if let Some(base) = frame_ptr[src] {
                    note(base + i64::from(insn.off));
                }
                frame_ptr[dst] = None;
            }
            BPF_ST | BPF_STX if mode == BPF_MEM || mode == BPF_ATOMIC => {
                if let Some(base) = frame_ptr[dst] {
                    note(base + i64::from(insn.off));
                }
            }
            BPF_ALU64 => {
                let op = insn.code & BPF_OP_MASK;
                let by_reg = insn.code & BPF_SRC_X != 0;
                frame_ptr[dst] = match (op, by_reg) {
                    (BPF_MOV, true) => frame_ptr[src],
                    (BPF_ADD, false) => frame_ptr[dst].map(|p| p + i64::from(insn.imm)),
                    (BPF_SUB, false) => frame_ptr[dst].map(|p| p - i64::from(insn.imm)),
                    _ => None,
                };
                if dst != usize::from(R10)
                    && let Some(p) = frame_ptr[dst]
                {
                    note(p);
                }
            }
            BPF_ALU | BPF_LD => frame_ptr[dst] = None,
            BPF_JMP if insn.code & BPF_OP_MASK == BPF_CALL => {
                // Calls clobber r0-r5.
                for reg in &mut frame_ptr[..=5] {
                    *reg = None;
                }
            }
            _ => {}
        }
        i += if insn.code == LD_IMM64 { 2 } else { 1 };
    }
    u32::try_from(deepest).unwrap_or(u32::MAX)
}

/// The oldest kernel vpcnet runs on: the oldest EKS nodes run (Amazon
/// Linux 2023 for Kubernetes 1.30-1.32), and the oldest the test matrix
/// boots. `bpf_loop` needs 5.17, `bpf_redirect_peer` 5.10.
pub const MIN_KERNEL: (u32, u32) = (6, 1);

/// `major.minor` of a release such as `6.1.0-50-amd64`.
pub fn release_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Why the verifier refused a program, in one line: the log's last line
/// that is not one of its statistics, with the processed-instructions
/// count when the log has it.
pub fn refusal_reason(log: &str) -> String {
    let is_stats = |line: &str| {
        [
            "processed ",
            "stack depth",
            "verification time",
            "max_states_per_insn",
        ]
        .iter()
        .any(|prefix| line.starts_with(prefix))
    };
    let lines: Vec<&str> = log
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let reason = lines
        .iter()
        .rev()
        .find(|line| !is_stats(line))
        .copied()
        .unwrap_or("no reason in the verifier's log");
    match lines.iter().find(|line| line.starts_with("processed ")) {
        Some(processed) => format!(
            "{reason} ({})",
            processed.split(" max_states").next().unwrap_or(processed)
        ),
        None => reason.to_owned(),
    }
}

/// What loading a program cost on this kernel.
#[derive(Clone, Debug)]
pub struct ProgramStats {
    pub name: &'static str,
    /// Instructions the verifier processed (`bpf_prog_info.verified_insns`).
    pub processed_insns: Option<u32>,
    /// Wall time of the load, verification included.
    pub load_time: Duration,
}

/// One program's cost on one kernel, against the budgets.
#[derive(Clone, Debug)]
pub struct Budget {
    pub stats: ProgramStats,
    pub stack: StackUse,
    /// The running kernel's rounding of frames.
    pub rounding: FrameRounding,
}

impl Budget {
    /// What is over budget, in words; empty when nothing is.
    pub fn overruns(&self) -> Vec<String> {
        let mut overruns = Vec::new();
        let before_6_9 = self.stack.combined(FrameRounding::Before6_9);
        if before_6_9 > STACK_BUDGET {
            overruns.push(format!(
                "{}: combined stack {before_6_9} bytes under the pre-6.9 rounding ({}), \
                 over the budget of {STACK_BUDGET} (the kernel's limit is {MAX_STACK})",
                self.stats.name, self.stack
            ));
        }
        match self.stats.processed_insns {
            Some(insns) if insns > INSN_BUDGET => overruns.push(format!(
                "{}: {insns} instructions processed, over the budget of {INSN_BUDGET} \
                 (the kernel's limit is {INSN_LIMIT})",
                self.stats.name
            )),
            Some(_) => {}
            None => overruns.push(format!(
                "{}: the kernel did not say how many instructions it processed",
                self.stats.name
            )),
        }
        overruns
    }
}

/// The budgets of the programs `stats` loaded from `object`, on a kernel
/// of release `release`.
pub fn budgets(
    stats: &[ProgramStats],
    object: &[u8],
    release: &str,
) -> Result<Vec<Budget>, StackError> {
    let stacks = stack_use(object)?;
    let rounding = FrameRounding::of_release(release);
    Ok(stats
        .iter()
        .map(|stats| Budget {
            stats: stats.clone(),
            stack: stacks
                .get(stats.name)
                .cloned()
                .unwrap_or(StackUse { chain: Vec::new() }),
            rounding,
        })
        .collect())
}

/// The running kernel's release, as `uname -r` prints it.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".to_owned(), |r| r.trim().to_owned())
}

/// The budgets as a table, one program a row, under a line naming the
/// kernel.
pub fn table(release: &str, budgets: &[Budget]) -> String {
    use std::fmt::Write as _;
    let rounding = FrameRounding::of_release(release);
    let mut out = format!(
        "kernel {release}: frames rounded {}\n",
        match rounding {
            FrameRounding::Before6_9 => "to 32 bytes (before 6.9)",
            FrameRounding::Jit16 => "to 16 bytes (6.9 and later, JIT)",
        }
    );
    let _ = writeln!(
        out,
        "{:<12} {:>9} {:>7} {:>8} {:>10} {:>9}  deepest chain (bytes per frame)",
        "program", "insns", "of 1M", "stack", "pre-6.9", "load"
    );
    for budget in budgets {
        let insns = budget
            .stats
            .processed_insns
            .map_or_else(|| "?".to_owned(), |n| n.to_string());
        let share = budget.stats.processed_insns.map_or_else(
            || "?".to_owned(),
            |n| format!("{:.1}%", f64::from(n) * 100.0 / f64::from(INSN_LIMIT)),
        );
        let _ = writeln!(
            out,
            "{:<12} {:>9} {:>7} {:>8} {:>10} {:>8.2}s  {}",
            budget.stats.name,
            insns,
            share,
            budget.stack.combined(budget.rounding),
            budget.stack.combined(FrameRounding::Before6_9),
            budget.stats.load_time.as_secs_f64(),
            budget.stack
        );
    }
    let _ = write!(
        out,
        "budgets: stack {STACK_BUDGET} of {MAX_STACK} bytes under the pre-6.9 rounding, \
         {INSN_BUDGET} of {INSN_LIMIT} processed instructions"
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> bpf_insn {
        let mut insn = bpf_insn {
            code,
            _bitfield_align_1: [],
            _bitfield_1: aya_obj::generated::__BindgenBitfieldUnit::new([0]),
            off,
            imm,
        };
        insn.set_dst_reg(dst);
        insn.set_src_reg(src);
        insn
    }

    const STX_DW: u8 = BPF_STX | BPF_MEM | 0x18;
    const LDX_W: u8 = BPF_LDX | BPF_MEM;
    const MOV64_X: u8 = BPF_ALU64 | BPF_MOV | BPF_SRC_X;
    const ADD64_K: u8 = BPF_ALU64 | BPF_ADD;
    const EXIT: u8 = BPF_JMP | 0x90;

    #[test]
    fn a_frame_is_as_deep_as_its_lowest_access_or_pointer() {
        let code = [
            insn(STX_DW, R10, 1, -8, 0),
            insn(LDX_W, 2, R10, -24, 0),
            // r1 = r10 - 64, handed to a helper.
            insn(MOV64_X, 1, R10, 0, 0),
            insn(ADD64_K, 1, 0, 0, -64),
            insn(BPF_JMP | BPF_CALL, 0, 0, 0, 1),
            // r1 is clobbered by the call: this is no stack access.
            insn(ADD64_K, 1, 0, 0, -400),
            insn(EXIT, 0, 0, 0, 0),
        ];
        assert_eq!(frame_depth(&code), 64);
        assert_eq!(frame_depth(&code[..2]), 24);
        assert_eq!(frame_depth(&[insn(EXIT, 0, 0, 0, 0)]), 0);
    }

    #[test]
    fn the_deepest_chain_follows_calls_and_callbacks() {
        // main (48) calls a (8) and references callback b (128), which
        // calls c (0).
        let code = [
            insn(STX_DW, R10, 1, -48, 0),
            insn(BPF_JMP | BPF_CALL, 0, BPF_PSEUDO_CALL, 0, 4), // -> 6 (a)
            insn(LD_IMM64, 2, BPF_PSEUDO_FUNC, 0, 5),           // -> 8 (b)
            insn(0, 0, 0, 0, 0),
            insn(BPF_JMP | BPF_CALL, 0, 0, 0, 181), // bpf_loop
            insn(EXIT, 0, 0, 0, 0),
            insn(STX_DW, R10, 1, -8, 0), // a
            insn(EXIT, 0, 0, 0, 0),
            insn(STX_DW, R10, 1, -128, 0),                      // b
            insn(BPF_JMP | BPF_CALL, 0, BPF_PSEUDO_CALL, 0, 1), // -> 11 (c)
            insn(EXIT, 0, 0, 0, 0),
            insn(EXIT, 0, 0, 0, 0), // c
        ];
        let linked = Linked::new(&code);
        assert_eq!(
            linked.subprogs.iter().map(|s| s.start).collect::<Vec<_>>(),
            [0, 6, 8, 11]
        );
        let chain = linked.deepest_chain(0, 0).unwrap();
        assert_eq!(chain, [0, 2, 3]);
        let stack = StackUse {
            chain: chain
                .iter()
                .map(|&s| Frame {
                    function: format!("f{s}"),
                    depth: linked.subprogs[s].depth,
                })
                .collect(),
        };
        assert_eq!(stack.to_string(), "f0 48 + f2 128 + f3 0");
        // Before 6.9: 64 + 128 + 32; from 6.9: 48 + 128 + 0.
        assert_eq!(stack.combined(FrameRounding::Before6_9), 224);
        assert_eq!(stack.combined(FrameRounding::Jit16), 176);
    }

    #[test]
    fn a_refusal_is_the_logs_reason_in_one_line() {
        // The end of 6.1's log for pod_egress before the stack fix.
        let log = "; return Ok(verdict)\n\
                   7651: (95) exit\n\
                   combined stack size of 3 calls is 544. Too large\n\
                   verification time 1402133 usec\n\
                   stack depth 360+0+128\n\
                   processed 45095 insns (limit 1000000) max_states_per_insn 13 total_states 2386 \
                   peak_states 1201 mark_read 146\n";
        assert_eq!(
            refusal_reason(log),
            "combined stack size of 3 calls is 544. Too large \
             (processed 45095 insns (limit 1000000))"
        );
        assert_eq!(refusal_reason(""), "no reason in the verifier's log");
    }

    #[test]
    fn releases_read_as_major_and_minor() {
        assert_eq!(release_version("6.1.0-50-amd64"), Some((6, 1)));
        assert_eq!(release_version("6.12.95+deb12-amd64"), Some((6, 12)));
        assert_eq!(
            release_version("5.10.240-238.955.amzn2.x86_64"),
            Some((5, 10))
        );
        assert_eq!(release_version("unknown"), None);
        assert!(release_version("5.10.240").unwrap() < MIN_KERNEL);
    }

    #[test]
    fn mangled_names_read_as_their_last_segment() {
        assert_eq!(
            readable_name("_RNvNtCs6g7wvZ8y74k_6vpcnet3nat10claim_step"),
            "claim_step"
        );
        assert_eq!(readable_name("memset"), "memset");
    }

    #[test]
    fn the_rounding_follows_the_release() {
        for (release, rounding) in [
            ("6.1.0-50-amd64", FrameRounding::Before6_9),
            ("6.8.12", FrameRounding::Before6_9),
            ("6.12.95+deb12-amd64", FrameRounding::Jit16),
            ("6.18.44-fc-v782", FrameRounding::Jit16),
        ] {
            assert_eq!(FrameRounding::of_release(release), rounding, "{release}");
        }
        // The 6.1 refusal: 360 + 0 + 128 is 544 there.
        let chain = StackUse {
            chain: [360, 128, 0]
                .map(|depth| Frame {
                    function: String::new(),
                    depth,
                })
                .into(),
        };
        assert_eq!(chain.combined(FrameRounding::Before6_9), 544);
    }
}
