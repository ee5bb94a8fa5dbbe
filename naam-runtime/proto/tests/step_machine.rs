//! The step machine against a scripted engine: every rule a placement enforces (hop limit,
//! retry budget and backoff, write-owner rules, checks on a step's output, faults) with no VM,
//! no memory and no clock.

use std::collections::VecDeque;

use bytes::Bytes;
use naam_ebpf::abi::{write_kind, Descriptor, Return, WriteOp, ACCESS_READ, ACCESS_WRITE};
use naam_proto::step::{
    Action, Engine, Grant, HandlerKind, Invocation, Limits, Outcome, StepFault, StepMachine,
    StepResult, WriteBatch, WriteError, MAX_RETRY_BACKOFF_NS,
};
use naam_proto::wire::{Descriptors, Request, Status};
use naam_proto::Placement;
use proptest::prelude::*;

/// What one scripted step leaves behind.
#[derive(Clone, Debug, Default)]
struct ScriptedStep {
    ret: Option<Return>,
    return_code: u64,
    reply: Vec<u8>,
    state0: u64,
    next: Vec<Descriptor>,
    writes: Vec<WriteOp>,
    write_data: Vec<u8>,
    fault: Option<StepFault>,
}

impl ScriptedStep {
    fn returning(ret: Return) -> Self {
        ScriptedStep {
            ret: Some(ret),
            return_code: ret.encode(),
            ..Default::default()
        }
    }
}

/// An engine that replays a script and records what each step was given.
#[derive(Default)]
struct ScriptedEngine {
    script: VecDeque<ScriptedStep>,
    current: ScriptedStep,
    state: [u64; naam_ebpf::abi::STATE_WORDS],
    seen: Vec<(u32, u32, u64, Vec<u8>, usize)>,
}

impl Engine for ScriptedEngine {
    type Program = ();

    fn run_step(
        &mut self,
        _program: &(),
        inv: &Invocation<'_>,
    ) -> Result<StepResult<'_>, StepFault> {
        self.seen.push((
            inv.step,
            inv.placement,
            inv.state[0],
            inv.reply.to_vec(),
            inv.segments.len(),
        ));
        self.current = self.script.pop_front().expect("the script ran out");
        if let Some(f) = self.current.fault.clone() {
            return Err(f);
        }
        self.state = [0u64; naam_ebpf::abi::STATE_WORDS];
        self.state[0] = self.current.state0;
        Ok(StepResult {
            return_code: self.current.return_code,
            ret: self.current.ret,
            insns: Some(10),
            mix: None,
            reply: &self.current.reply,
            state: &self.state,
            next: &self.current.next,
            writes: &self.current.writes,
            write_data: &self.current.write_data,
        })
    }

    fn queued_writes(&self) -> (&[WriteOp], &[u8]) {
        (&self.current.writes, &self.current.write_data)
    }
}

/// A batch the owner was given, kept (the machine lends it from the engine, which the next
/// step overwrites).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Applied {
    app: u32,
    request_id: u64,
    ops: Vec<WriteOp>,
    targets: Vec<Descriptor>,
    data: Vec<u8>,
}

impl Applied {
    fn of(b: &WriteBatch<'_>) -> Applied {
        Applied {
            app: b.app,
            request_id: b.request_id,
            ops: b.ops.to_vec(),
            targets: b.targets.to_vec(),
            data: b.data.to_vec(),
        }
    }

    /// The batch again, as the owner saw it.
    fn view(&self) -> WriteBatch<'_> {
        WriteBatch {
            app: self.app,
            request_id: self.request_id,
            ops: &self.ops,
            targets: &self.targets,
            data: &self.data,
        }
    }
}

fn desc(rkey: u64, len: u32, access: u32) -> Descriptor {
    Descriptor {
        rkey,
        offset: 0,
        len,
        access,
    }
}

fn request(descs: &[Descriptor]) -> Request {
    Request::new(
        7,
        1,
        42,
        Bytes::from_static(b"args"),
        Descriptors::from_slice(descs).expect("descriptors fit"),
    )
}

/// Drives the machine as a driver would (fetch = one zero-length grant per descriptor, fetch
/// cost 5 ns), applying writes with `apply`; returns the outcome and every batch.
fn drive(
    req: &Request,
    kind: HandlerKind,
    placement: Placement,
    limits: Limits,
    engine: &mut ScriptedEngine,
    apply: impl FnMut(&WriteBatch<'_>) -> Result<(), WriteError>,
) -> (Outcome, Vec<Applied>) {
    let (mut m, action) = StepMachine::start(req.into(), 7, kind, placement, limits);
    run(&mut m, action, req, engine, apply)
}

/// Runs `m` from `action` to its outcome (see [`drive`]), collecting the batches applied.
fn run(
    m: &mut StepMachine,
    mut action: Action,
    req: &Request,
    engine: &mut ScriptedEngine,
    mut apply: impl FnMut(&WriteBatch<'_>) -> Result<(), WriteError>,
) -> (Outcome, Vec<Applied>) {
    let mut batches = Vec::new();
    let buf = [0u8; 0];
    loop {
        action = match action {
            Action::Complete => return (m.outcome(), batches),
            Action::Fetch => {
                let grants: Vec<Grant<'_>> = m
                    .current()
                    .as_slice()
                    .iter()
                    .map(|_| Grant::read(&buf))
                    .collect();
                let r = engine.run_step(&(), &m.invocation(&req.args, &grants));
                m.stepped(r, 5)
            }
            Action::Write => {
                let b = m.writes(engine);
                let r = apply(&b);
                batches.push(Applied::of(&b));
                m.writes_applied(r)
            }
        };
    }
}

/// Drives a read handler at the host with the default limits; no write may reach an owner.
fn run_read(req: &Request, engine: &mut ScriptedEngine) -> Outcome {
    let (o, _) = drive(
        req,
        HandlerKind::Read,
        Placement::Host,
        Limits::default(),
        engine,
        |_| unreachable!("a read handler's batch reached the owner"),
    );
    o
}

/// Drives a write handler at its owner (the host) with the default limits; `owner` applies
/// each batch.
fn run_write(
    req: &Request,
    engine: &mut ScriptedEngine,
    owner: impl FnMut(&WriteBatch<'_>) -> Result<(), WriteError>,
) -> (Outcome, Vec<Applied>) {
    drive(
        req,
        HandlerKind::Write,
        Placement::Host,
        Limits::default(),
        engine,
        owner,
    )
}

fn script(steps: impl IntoIterator<Item = ScriptedStep>) -> ScriptedEngine {
    ScriptedEngine {
        script: steps.into_iter().collect(),
        ..Default::default()
    }
}

#[test]
fn continue_carries_state_reply_and_next_descriptors() {
    let next = desc(9, 16, ACCESS_READ);
    let mut first = ScriptedStep::returning(Return::Continue);
    first.reply = b"half".to_vec();
    first.state0 = 77;
    first.next = vec![next, next];
    let mut second = ScriptedStep::returning(Return::Done);
    second.reply = b"whole".to_vec();
    let mut e = script([first, second]);
    let (o, _) = drive(
        &request(&[desc(1, 8, ACCESS_READ)]),
        HandlerKind::Read,
        Placement::Nic,
        Limits::default(),
        &mut e,
        |_| unreachable!(),
    );
    assert_eq!(o.status, Status::Ok);
    assert_eq!(&o.payload[..], b"whole");
    assert_eq!(o.steps, 2);
    assert_eq!(o.insns, 20);
    assert_eq!((o.runs, o.fetch_ns), (2, 10));
    // Step 1 saw step 0's state, reply and two segments, at the NIC's placement code.
    assert_eq!(e.seen[0], (0, Placement::Nic.abi(), 0, Vec::new(), 1));
    assert_eq!(
        e.seen[1],
        (1, Placement::Nic.abi(), 77, b"half".to_vec(), 2)
    );
}

#[test]
fn hop_limit_ends_a_message_that_keeps_continuing() {
    let mut step = ScriptedStep::returning(Return::Continue);
    step.next = vec![desc(1, 8, ACCESS_READ)];
    let limits = Limits::new(4, 1);
    let mut e = script(std::iter::repeat_n(step, 4));
    let (o, _) = drive(
        &request(&[desc(1, 8, ACCESS_READ)]),
        HandlerKind::Read,
        Placement::Host,
        limits,
        &mut e,
        |_| unreachable!(),
    );
    assert_eq!(o.status, Status::HopLimit);
    assert_eq!(o.steps, 4);
    // A continuation that arrives with its budget spent does not run at all.
    let mut spent = request(&[desc(1, 8, ACCESS_READ)]);
    spent.steps = 4;
    let (mut m, action) = StepMachine::start(
        (&spent).into(),
        7,
        HandlerKind::Read,
        Placement::Host,
        limits,
    );
    assert_eq!(action, Action::Complete);
    assert_eq!(m.outcome().status, Status::HopLimit);
}

#[test]
fn continue_with_invalid_next_descriptors_is_refused() {
    for next in [
        vec![desc(1, 8, 0)],                         // no rights
        vec![desc(1, 8, 0x8000_0000 | ACCESS_READ)], // unknown rights
        vec![desc(1, 8, ACCESS_READ); 64],           // more than a step may fetch
    ] {
        let mut step = ScriptedStep::returning(Return::Continue);
        step.next = next.clone();
        let mut e = script([step]);
        let o = run_read(&request(&[desc(1, 8, ACCESS_READ)]), &mut e);
        assert_eq!(o.status, Status::Refused, "next = {next:?}");
    }
}

#[test]
fn retries_discard_the_torn_step_and_back_off_up_to_the_budget() {
    let mut torn = ScriptedStep::returning(Return::Retry);
    torn.reply = b"garbage".to_vec();
    torn.state0 = 666;
    let mut done = ScriptedStep::returning(Return::Done);
    done.reply = b"ok".to_vec();
    let mut e = script([torn.clone(), torn.clone(), done]);
    let o = run_read(&request(&[desc(1, 8, ACCESS_READ)]), &mut e);
    assert_eq!((o.status, o.steps, o.retries), (Status::Ok, 1, 2));
    assert_eq!(&o.payload[..], b"ok");
    // Every attempt ran as step 0 with the original state and an empty reply.
    assert!(e
        .seen
        .iter()
        .all(|s| s.0 == 0 && s.2 == 0 && s.3.is_empty()));

    // Backoff doubles from 1 µs and is capped.
    let limits = Limits::new(32, 40);
    let retried = request(&[desc(1, 8, ACCESS_READ)]);
    let (mut m, _) = StepMachine::start(
        (&retried).into(),
        7,
        HandlerKind::Read,
        Placement::Host,
        limits,
    );
    assert_eq!(m.retry_backoff_ns(), None);
    let mut e = script(std::iter::repeat_n(
        ScriptedStep::returning(Return::Retry),
        41,
    ));
    let mut waits = Vec::new();
    let buf = [0u8; 8];
    let outcome = loop {
        let grants = [Grant::read(&buf)];
        let r = e.run_step(&(), &m.invocation(&retried.args, &grants));
        match m.stepped(r, 0) {
            Action::Fetch => waits.push(m.retry_backoff_ns().expect("a retry waits")),
            Action::Complete => break m.outcome(),
            Action::Write => unreachable!(),
        }
    };
    assert_eq!(&waits[..4], &[1_000, 2_000, 4_000, 8_000]);
    assert_eq!(waits.last(), Some(&MAX_RETRY_BACKOFF_NS));
    assert_eq!(outcome.status, Status::Refused);
    assert_eq!(outcome.retries, 41);
}

fn write_step(writes: Vec<WriteOp>, data: &[u8]) -> ScriptedStep {
    let mut s = ScriptedStep::returning(Return::Write);
    s.writes = writes;
    s.write_data = data.to_vec();
    s
}

fn store(segment: u32, offset: u32, len: u32, data_offset: u32) -> WriteOp {
    WriteOp {
        kind: write_kind::STORE,
        segment,
        offset,
        len,
        data_offset,
        ..Default::default()
    }
}

#[test]
fn writes_are_checked_against_their_segments_and_applied_at_the_owner() {
    let target = desc(3, 16, ACCESS_READ | ACCESS_WRITE);
    let cas = WriteOp {
        kind: write_kind::CAS,
        segment: 0,
        offset: 8,
        len: 8,
        operand: 5,
        expected: 4,
        ..Default::default()
    };
    let mut e = script([write_step(vec![store(0, 0, 4, 2), cas], b"..abcd")]);
    let (o, batches) = run_write(&request(&[target]), &mut e, |_| Ok(()));
    assert_eq!(o.status, Status::Ok);
    assert_eq!(batches.len(), 1);
    let b = &batches[0];
    assert_eq!((b.app, b.request_id, b.ops.len()), (7, 42, 2));
    assert_eq!(b.view().target(&b.ops[0]), Some(&target));
    assert_eq!(b.view().bytes(&b.ops[0]), b"abcd");
    assert_eq!((b.ops[1].operand, b.ops[1].expected), (5, 4));

    // The owner's refusal becomes the reply.
    let mut e = script([write_step(vec![cas], b"")]);
    let (o, _) = run_write(&request(&[target]), &mut e, |_| {
        Err(WriteError::Conflict {
            index: 0,
            expected: 4,
            found: 9,
        })
    });
    assert_eq!(o.status, Status::Conflict);
}

#[test]
fn malformed_writes_are_refused_before_reaching_the_owner() {
    let target = desc(3, 16, ACCESS_READ | ACCESS_WRITE);
    let bad = [
        (store(1, 0, 4, 0), "targets segment 1 of 1"),
        (store(0, 14, 4, 0), "runs past its segment (18 > 16)"),
        (store(0, 0, 4, 6), "data outside the staging buffer"),
        (
            WriteOp {
                kind: write_kind::FAA,
                len: 4,
                ..Default::default()
            },
            "atomics are 8 bytes",
        ),
        (
            WriteOp {
                kind: 99,
                len: 8,
                ..Default::default()
            },
            "unknown kind 99",
        ),
    ];
    for (op, why) in bad {
        let mut e = script([write_step(vec![op], b"abcdefgh")]);
        let (o, batches) = run_write(&request(&[target]), &mut e, |_| {
            panic!("a malformed batch reached the owner")
        });
        assert_eq!(o.status, Status::Refused, "{op:?}");
        let reason = String::from_utf8_lossy(&o.payload);
        assert!(reason.contains(why), "{op:?}: {reason}");
        assert!(batches.is_empty());
    }
}

#[test]
fn placement_and_kind_rules() {
    // A write handler never starts at the client.
    let (mut m, action) = StepMachine::start(
        (&request(&[desc(1, 8, ACCESS_READ)])).into(),
        7,
        HandlerKind::Write,
        Placement::Client,
        Limits::default(),
    );
    assert_eq!(action, Action::Complete);
    assert_eq!(m.outcome().status, Status::PlacementRefused);
    // A read handler that returns Write is refused.
    let mut e = script([write_step(vec![store(0, 0, 1, 0)], b"x")]);
    // (run_read fails the test if a batch reaches the owner.)
    let o = run_read(&request(&[desc(1, 8, ACCESS_READ | ACCESS_WRITE)]), &mut e);
    assert_eq!(o.status, Status::Refused);
}

#[test]
fn faults_and_bad_returns_map_to_their_statuses() {
    let cases = [
        (
            ScriptedStep {
                fault: Some(StepFault::Aborted {
                    code: 0x1_0000_0007,
                }),
                ..Default::default()
            },
            Status::Aborted,
            7,
        ),
        (
            ScriptedStep {
                fault: Some(StepFault::BadInput("args too long".into())),
                ..Default::default()
            },
            Status::Refused,
            0,
        ),
        (
            ScriptedStep {
                fault: Some(StepFault::Fault("out of bounds".into())),
                ..Default::default()
            },
            Status::Fault,
            0,
        ),
        (
            ScriptedStep {
                return_code: 0xff,
                ..Default::default()
            },
            Status::Fault,
            0,
        ),
        (
            ScriptedStep::returning(Return::Error(13)),
            Status::HandlerError,
            13,
        ),
    ];
    for (step, status, code) in cases {
        let mut e = script([step.clone()]);
        let o = run_read(&request(&[desc(1, 8, ACCESS_READ)]), &mut e);
        assert_eq!((o.status, o.code), (status, code), "{step:?}");
        assert_eq!(o.runs, 1, "a faulted step is still accounted");
    }
}

fn any_step() -> impl Strategy<Value = ScriptedStep> {
    let ret = prop_oneof![
        Just(Some(Return::Done)),
        Just(Some(Return::Continue)),
        Just(Some(Return::Write)),
        Just(Some(Return::Retry)),
        any::<u32>().prop_map(|c| Some(Return::Error(c))),
        Just(None),
    ];
    let d =
        (any::<u64>(), 0u32..64, 0u32..16).prop_map(|(rkey, len, access)| desc(rkey, len, access));
    let w = (0u32..4, 0u32..4, 0u32..80, 0u32..20, 0u32..40).prop_map(
        |(kind, segment, offset, len, data_offset)| WriteOp {
            kind,
            segment,
            offset,
            len,
            data_offset,
            ..Default::default()
        },
    );
    (
        ret,
        proptest::collection::vec(any::<u8>(), 0..8),
        proptest::collection::vec(d, 0..12),
        proptest::collection::vec(w, 0..4),
        proptest::collection::vec(any::<u8>(), 0..32),
    )
        .prop_map(|(ret, reply, next, writes, write_data)| ScriptedStep {
            ret,
            return_code: ret.map_or(0xee, Return::encode),
            reply,
            next,
            writes,
            write_data,
            ..Default::default()
        })
}

proptest! {
    /// Whatever a handler leaves behind, the machine ends within its step and retry budgets,
    /// never hands the owner an operation outside its segment, and accounts every step.
    #[test]
    fn any_handler_output_ends_within_budget(
        steps in proptest::collection::vec(any_step(), 1..80),
        kind in prop_oneof![Just(HandlerKind::Read), Just(HandlerKind::Write)],
    ) {
        let limits = Limits::new(8, 4);
        let mut script_steps = steps.clone();
        // Past the random steps the handler finishes, so every run ends.
        script_steps.extend(std::iter::repeat_n(ScriptedStep::returning(Return::Done), 16));
        let mut e = script(script_steps);
        let req = request(&[desc(1, 32, ACCESS_READ | ACCESS_WRITE)]);
        let (o, batches) = drive(&req, kind, Placement::Host, limits, &mut e, |_| Ok(()));
        prop_assert!(o.steps <= limits.max_steps);
        prop_assert!(o.retries <= limits.max_retries + 1);
        prop_assert_eq!(o.runs as usize, e.seen.len());
        prop_assert!(batches.len() <= 1);
        for b in &batches {
            prop_assert_eq!(kind, HandlerKind::Write);
            for op in &b.ops {
                let len = if op.kind == write_kind::STORE { b.view().bytes(op).len() as u64 } else { 8 };
                let target = b.view().target(op).expect("the machine checked the index");
                prop_assert!(op.offset as u64 + len <= target.len as u64, "{:?}", op);
            }
        }
    }
}

/// One scripted message: a read or a write, its steps' replies, and whether it ends in an
/// error.
fn message() -> impl Strategy<Value = (bool, Vec<Vec<u8>>, bool)> {
    (
        any::<bool>(),
        proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..4),
        any::<bool>(),
    )
}

fn script_of(write: bool, replies: &[Vec<u8>], fails: bool) -> Vec<ScriptedStep> {
    let last = replies.len() - 1;
    replies
        .iter()
        .enumerate()
        .map(|(i, reply)| {
            let ret = match (i == last, write, fails) {
                (false, ..) => Return::Continue,
                (true, _, true) => Return::Error(3),
                (true, true, false) => Return::Write,
                (true, false, false) => Return::Done,
            };
            ScriptedStep {
                reply: reply.clone(),
                next: if i == last {
                    vec![]
                } else {
                    vec![desc(1, 8, ACCESS_READ)]
                },
                writes: if ret == Return::Write {
                    vec![WriteOp {
                        segment: 0,
                        kind: write_kind::STORE,
                        offset: 0,
                        len: 4,
                        data_offset: 0,
                        ..WriteOp::default()
                    }]
                } else {
                    vec![]
                },
                write_data: vec![9; 4],
                ..ScriptedStep::returning(ret)
            }
        })
        .collect()
}

proptest! {
    /// One machine restarted for message after message answers exactly as a new machine per
    /// message, and the payloads it handed out stay intact while later messages run in it
    /// (they share its buffers).
    #[test]
    fn a_restarted_machine_answers_as_new_ones(messages in proptest::collection::vec(message(), 1..40)) {
        let req = request(&[desc(1, 8, ACCESS_READ | ACCESS_WRITE)]);
        let mut reused = StepMachine::unused();
        let mut kept = Vec::new();
        for (write, replies, fails) in &messages {
            let kind = if *write { HandlerKind::Write } else { HandlerKind::Read };
            let mut engine = ScriptedEngine {
                script: script_of(*write, replies, *fails).into(),
                ..Default::default()
            };
            let (fresh, fresh_batches) =
                drive(&req, kind, Placement::Host, Limits::default(), &mut engine, |_| Ok(()));
            let mut engine = ScriptedEngine {
                script: script_of(*write, replies, *fails).into(),
                ..Default::default()
            };
            let action = reused.restart((&req).into(), 7, kind, Placement::Host, Limits::default());
            let (again, again_batches) = run(&mut reused, action, &req, &mut engine, |_| Ok(()));
            prop_assert_eq!(&fresh, &again);
            prop_assert_eq!(fresh_batches, again_batches);
            kept.push(again);
        }
        for ((_, replies, _), o) in messages.iter().zip(&kept) {
            let last_reply: &[u8] = replies.last().map(|r| &r[..]).unwrap_or(&[]);
            prop_assert_eq!(&o.payload[..], last_reply);
        }
    }
}
