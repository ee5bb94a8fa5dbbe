//! The in-process cluster: replies at every placement, bad input, back-pressure, write
//! ownership, deduplication, handoff, the async client.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{rd, words};
use naam_ebpf::abi::{Descriptor, ACCESS_ATOMIC, ACCESS_READ, ACCESS_WRITE};
use naam_proto::handler_id;
use naam_proto::wire::{flags, Descriptors, Request, Status};
use naam_proto::Placement;
use naam_runtime::cluster::{AppSpec, Cluster, ClusterConfig, PolicyChoice, RegionSpec};
use naam_runtime::HandlerSpec;
use naam_runtime::ALL_RIGHTS;

const APP: u32 = 3;

fn app() -> AppSpec {
    common::examples_app(APP)
}

fn cluster(config: ClusterConfig) -> Cluster {
    Cluster::builder()
        .config(config)
        .app(app())
        .build()
        .unwrap()
}

/// The counter word the `counter_add` tests write: the data region's third word, with every
/// right a write needs.
fn counter_cell(c: &Cluster) -> Descriptor {
    Descriptor {
        rkey: c.region_key(APP, "data").unwrap(),
        offset: 16,
        len: 8,
        access: ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
    }
}

/// The counter word's value now.
fn counter(c: &Cluster) -> u64 {
    u64::from_le_bytes(
        c.region_snapshot(APP, "data").unwrap()[16..24]
            .try_into()
            .unwrap(),
    )
}

#[test]
fn same_replies_at_every_placement_and_multi_step() {
    let c = cluster(ClusterConfig::functional());
    let sorted = c.region_key(APP, "sorted").unwrap();
    let data = c.region_key(APP, "data").unwrap();
    let mut client = c.client();
    for key in [0u64, 3, 4, 1000, 2044, 5000] {
        let mut replies = Vec::new();
        for p in Placement::ALL {
            let r = client
                .call_at(
                    p,
                    APP,
                    handler_id("bsearch"),
                    &words(&[key]),
                    &[rd(sorted, 0, 4096)],
                )
                .unwrap();
            assert_eq!((r.status, r.placement), (Status::Ok, p));
            replies.push(r.payload);
        }
        assert!(replies.windows(2).all(|w| w[0] == w[1]), "key {key}");
    }
    for p in Placement::ALL {
        let r = client
            .call_at(
                p,
                APP,
                handler_id("two_step"),
                &words(&[data]),
                &[rd(data, 0, 16)],
            )
            .unwrap();
        assert_eq!(
            (r.status, r.steps, &r.payload[..]),
            (Status::Ok, 2, &words(&[1042])[..]),
            "{p}"
        );
    }
    // Steered calls work too, and metrics count them.
    for _ in 0..100 {
        let r = client
            .call(APP, handler_id("add"), &words(&[1, 2]), &[])
            .unwrap();
        assert_eq!(&r.payload[..], &words(&[3])[..]);
    }
    let snap = c.metrics().snapshot();
    assert!(snap.ops.iter().sum::<u64>() >= 100 + 18 + 3);
}

#[test]
fn bad_input_gets_error_replies_and_the_cluster_keeps_serving() {
    let c = cluster(ClusterConfig::functional());
    let sorted = c.region_key(APP, "sorted").unwrap();
    let mut client = c.client();
    let ok = |client: &mut naam_runtime::cluster::Client| {
        let r = client
            .call(APP, handler_id("add"), &words(&[2, 2]), &[])
            .unwrap();
        assert_eq!(r.status, Status::Ok);
    };
    // Malformed bytes.
    for junk in [&b""[..], b"garbage", &[1u8; 31], &[1u8; 200]] {
        let r = c.submit_bytes(Bytes::copy_from_slice(junk));
        assert_eq!(
            r.status,
            Status::Malformed,
            "{}",
            String::from_utf8_lossy(&r.payload)
        );
    }
    ok(&mut client);
    // Unknown handler, unknown app.
    assert_eq!(
        client.call(APP, 0x1234, &[], &[]).unwrap().status,
        Status::UnknownHandler
    );
    assert_eq!(
        client.call(99, handler_id("add"), &[], &[]).unwrap().status,
        Status::UnknownApp
    );
    // Bad keys, ranges, rights, at every placement.
    for p in Placement::ALL {
        let cases = [
            (rd(0xbad, 0, 8), Status::BadKey),
            (rd(sorted, 4090, 16), Status::OutOfRange),
            (
                Descriptor {
                    rkey: sorted,
                    offset: 0,
                    len: 8,
                    access: ACCESS_READ | ACCESS_WRITE,
                },
                Status::AccessDenied,
            ),
        ];
        for (d, want) in cases {
            let r = client
                .call_at(p, APP, handler_id("bsearch"), &words(&[1]), &[d])
                .unwrap();
            assert_eq!(r.status, want, "{p} {d:?}");
        }
        let r = client
            .call_at(p, APP, handler_id("panics"), &words(&[7]), &[])
            .unwrap();
        assert_eq!(r.status, Status::Aborted);
    }
    // A write aimed at the read-only region.
    let w = Descriptor {
        rkey: sorted,
        offset: 0,
        len: 8,
        access: ACCESS_READ | ACCESS_WRITE | ACCESS_ATOMIC,
    };
    assert_eq!(
        client
            .call(APP, handler_id("counter_add"), &words(&[1]), &[w])
            .unwrap()
            .status,
        Status::AccessDenied
    );
    // Oversized args are refused before sending.
    assert!(client
        .call(
            APP,
            handler_id("add"),
            &vec![0u8; naam_ebpf::abi::ARGS_CAP + 1],
            &[]
        )
        .is_err());
    ok(&mut client);
    assert!(c
        .metrics()
        .snapshot()
        .errors
        .iter()
        .any(|(s, _)| *s == Status::BadKey));
}

#[test]
#[cfg(feature = "async")] // floods through the tokio client (scripts/test.sh runs it)
fn full_queues_give_back_pressure_errors() {
    let mut config = ClusterConfig::functional();
    config.queue_capacity = 2;
    let c = cluster(config);
    // Make the host slow, then flood it from an async client.
    c.congestion().limit_host(2_000_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ac = c.async_client();
    let w = counter_cell(&c);
    let results = rt.block_on(async {
        let calls = (0..12).map(|_| {
            let ac = ac.clone();
            async move {
                ac.call(APP, handler_id("counter_add"), &words(&[1]), &[w])
                    .await
            }
        });
        futures_join_all(calls).await
    });
    let busy = results
        .iter()
        .filter(|r| {
            matches!(
                r,
                Err(naam_proto::transport::ClientError::Busy(Placement::Host))
            )
        })
        .count();
    let ok = results
        .iter()
        .filter(|r| matches!(r, Ok(rep) if rep.status == Status::Ok))
        .count();
    assert!(busy > 0, "some calls must see back-pressure: {results:?}");
    assert_eq!(ok + busy, 12);
    c.congestion().clear();
    // Refused writes left no in-flight count behind: an owner handoff drains at once.
    c.move_owner(APP, Placement::Nic, Duration::from_secs(1))
        .expect("no leaked in-flight writes");
    // Nothing was lost: every accepted increment landed exactly once.
    let counter = counter(&c);
    assert_eq!(counter as usize, ok);
}

/// Polls futures to completion concurrently (no extra dependency).
#[cfg(feature = "async")]
async fn futures_join_all<F: std::future::Future>(
    fs: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    let handles: Vec<_> = fs.into_iter().map(|f| Box::pin(f)).collect();
    let mut out = Vec::new();
    let mut pending: Vec<_> = handles.into_iter().map(Some).collect();
    let mut results: Vec<Option<F::Output>> = (0..pending.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (i, slot) in pending.iter_mut().enumerate() {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        results[i] = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    for r in results {
        out.push(r.expect("completed"));
    }
    out
}

#[test]
fn retried_writes_apply_once() {
    let c = cluster(ClusterConfig::functional());
    let w = counter_cell(&c);
    let mut client = c.client();
    let mut req = Request::new(
        APP,
        handler_id("counter_add"),
        0,
        Bytes::from(words(&[5])),
        Descriptors::from_slice(&[w]).unwrap(),
    );
    req.request_id = 0xfeed;
    req.flags = flags::WRITE | flags::RETRY;
    for _ in 0..3 {
        let r = client.send(None, req.clone()).unwrap();
        assert_eq!(r.status, Status::Ok);
    }
    let counter = counter(&c);
    assert_eq!(counter, 5, "three deliveries of one request id add once");
}

/// A request handed in by a client in the server's process exists once (its client never
/// sends it again), so its write takes no deduplication entry: the table's insert and
/// eviction are spared. Seen from outside: the same id handed in again (which no client does)
/// is applied again, and a datagram's write under that id afterwards is still deduplicated
/// against its own first delivery.
#[test]
fn handed_in_writes_take_no_dedup_entry() {
    let c = cluster(ClusterConfig::functional());
    let w = counter_cell(&c);
    let mut client = c.client();
    let mut req = Request::new(
        APP,
        handler_id("counter_add"),
        0xbeef,
        Bytes::from(words(&[5])),
        Descriptors::from_slice(&[w]).unwrap(),
    );
    // RETRY: the client keeps the id given, as a resend does.
    req.flags = flags::WRITE | flags::RETRY;
    req.handed_in = true;
    for _ in 0..2 {
        assert_eq!(client.send(None, req.clone()).unwrap().status, Status::Ok);
    }
    assert_eq!(counter(&c), 10, "no entry: each hand-in is applied");
    req.handed_in = false;
    for _ in 0..2 {
        assert_eq!(client.send(None, req.clone()).unwrap().status, Status::Ok);
    }
    assert_eq!(counter(&c), 15, "a datagram's copies apply once");
}

#[test]
fn owner_handoff_loses_and_duplicates_nothing() {
    // The handoff mechanism alone: a static policy never moves the owner by itself.
    let mut config = ClusterConfig::functional();
    config.policy = PolicyChoice::Always(Placement::Host);
    config.nic_executors = 1;
    let c = Arc::new(cluster(config));
    let w = counter_cell(&c);
    let writer = {
        let c = c.clone();
        std::thread::spawn(move || {
            let mut client = c.client();
            let mut applied = 0u64;
            for _ in 0..3000 {
                // Busy during a handoff: retry the same request until it lands.
                loop {
                    let r = client
                        .call(APP, handler_id("counter_add"), &words(&[1]), &[w])
                        .unwrap();
                    match r.status {
                        Status::Ok => {
                            applied += 1;
                            break;
                        }
                        Status::Busy => std::thread::yield_now(),
                        s => panic!("unexpected {s:?}"),
                    }
                }
            }
            applied
        })
    };
    let mut epochs = 0;
    for i in 0..10 {
        std::thread::sleep(Duration::from_millis(2));
        let to = if i % 2 == 0 {
            Placement::Nic
        } else {
            Placement::Host
        };
        epochs = c.move_owner(APP, to, Duration::from_secs(5)).unwrap();
        assert_eq!(c.owner(APP), Some(to));
    }
    let applied = writer.join().unwrap();
    assert_eq!(epochs, 10);
    let counter = counter(&c);
    assert_eq!(counter, applied);
    assert_eq!(applied, 3000);
}

#[test]
#[cfg(feature = "async")] // floods through the tokio client (scripts/test.sh runs it)
fn async_client_many_in_flight() {
    let c = cluster(ClusterConfig::functional());
    let sorted = c.region_key(APP, "sorted").unwrap();
    let ac = c.async_client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let results = rt.block_on(futures_join_all((0..200u64).map(|k| {
        let ac = ac.clone();
        async move {
            ac.call(
                APP,
                handler_id("bsearch"),
                &words(&[k * 4]),
                &[rd(sorted, 0, 4096)],
            )
            .await
        }
    })));
    for (k, r) in results.into_iter().enumerate() {
        let r = r.unwrap();
        assert_eq!(r.status, Status::Ok);
        assert_eq!(&r.payload[..], &words(&[k as u64, 1])[..]);
    }
}

#[test]
fn static_policies_pin_reads() {
    for p in Placement::ALL {
        let mut config = ClusterConfig::functional();
        config.policy = PolicyChoice::Always(p);
        let c = cluster(config);
        std::thread::sleep(Duration::from_millis(5));
        let mut client = c.client();
        for _ in 0..50 {
            let r = client
                .call(APP, handler_id("add"), &words(&[1, 1]), &[])
                .unwrap();
            assert_eq!(r.placement, p);
        }
    }
}

#[test]
fn optimistic_reads_are_never_torn_at_any_placement() {
    let mut spec = app();
    spec.regions.push(RegionSpec {
        name: "rec".into(),
        access: ALL_RIGHTS,
        contents: words(&[0, 0, !0, 0]),
    });
    // `vget` is one of the examples app's handlers; `vput` is added here.
    spec.handlers.push(HandlerSpec::write("vput"));
    let c = Arc::new(
        Cluster::builder()
            .config(ClusterConfig::functional())
            .app(spec)
            .build()
            .unwrap(),
    );
    let rec = c.region_key(APP, "rec").unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (c, stop) = (c.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut client = c.client();
            let w = Descriptor {
                rkey: rec,
                offset: 0,
                len: 32,
                access: ACCESS_READ | ACCESS_WRITE,
            };
            let mut a = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                a += 1;
                // Busy (a write-owner handoff in progress) is transient: retry.
                loop {
                    let r = client
                        .call(APP, handler_id("vput"), &words(&[a]), &[w])
                        .unwrap();
                    match r.status {
                        Status::Ok => break,
                        Status::Busy => std::thread::yield_now(),
                        s => panic!("vput: {s:?}"),
                    }
                }
            }
            a
        })
    };
    let mut client = c.client();
    let mut last = [0u64; 3];
    for i in 0..6000 {
        let p = Placement::ALL[i % 3];
        let r = client
            .call_at(p, APP, handler_id("vget"), &[], &[rd(rec, 0, 32)])
            .unwrap();
        assert_eq!(
            r.status,
            Status::Ok,
            "{p}: {}",
            String::from_utf8_lossy(&r.payload)
        );
        let a = u64::from_le_bytes(r.payload[..8].try_into().unwrap());
        let b = u64::from_le_bytes(r.payload[8..16].try_into().unwrap());
        assert_eq!(b, !a, "torn read at {p}: a={a} b={b:#x}");
        assert!(a >= last[p.index()], "values go forward at {p}");
        last[p.index()] = a;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let written = writer.join().unwrap();
    assert!(written > 0);
}

#[test]
fn steering_moves_the_write_owner_off_a_congested_host() {
    let c = Arc::new(cluster(ClusterConfig::functional()));
    let w = counter_cell(&c);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Reads keep every placement's signals fresh (probes); writes go to the owner.
    let reader = {
        let (c, stop) = (c.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut client = c.client();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = client.call(APP, handler_id("add"), &words(&[1, 2]), &[]);
            }
        })
    };
    let writer = {
        let (c, stop) = (c.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut client = c.client();
            let mut applied = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = client
                    .call(APP, handler_id("counter_add"), &words(&[1]), &[w])
                    .unwrap();
                match r.status {
                    Status::Ok => applied += 1,
                    Status::Busy => std::thread::yield_now(),
                    s => panic!("unexpected {s:?}"),
                }
            }
            applied
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    // CPU contention on a small machine can already look like congestion: start from the host.
    c.move_owner(APP, Placement::Host, Duration::from_secs(5))
        .unwrap();
    c.congestion().limit_host(300_000);
    // Functional bound, generous on purpose: the measured reaction time is a benchmark figure.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while c.owner(APP) != Some(Placement::Nic) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let moved = c.owner(APP);
    c.congestion().clear();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().unwrap();
    let applied = writer.join().unwrap();
    assert_eq!(
        moved,
        Some(Placement::Nic),
        "the owner left the congested host"
    );
    let counter = counter(&c);
    assert_eq!(
        counter, applied,
        "no write lost or doubled across the handoff"
    );
}

#[test]
fn writes_stay_at_the_host_when_the_nic_is_another_process() {
    // Behind the UDP fabric naam-nic takes reads and one-sided operations, never writes: a
    // congested host must not hand write ownership to it (every write would be refused).
    let mut config = ClusterConfig::functional();
    config.remote_nic = true;
    config.nic_executors = 0;
    let c = cluster(config);
    let e = c
        .move_owner(APP, Placement::Nic, Duration::from_secs(1))
        .unwrap_err();
    assert!(e.to_string().contains("cannot own writes"), "{e}");
    assert_eq!(c.owner(APP), Some(Placement::Host));
}

/// Executor queues are fair between apps: one app's backlog of expensive messages (each runs
/// to its instruction budget) does not stand between another app's message and the executor.
/// With one shared FIFO the cheap message would wait for the whole backlog.
#[test]
fn a_cheap_app_is_served_past_another_apps_expensive_backlog() {
    const HOG: u32 = 7;
    let c = Cluster::builder()
        .config(ClusterConfig::functional())
        .app(app())
        .app(common::examples_app(HOG).with_budget(2_000_000))
        .build()
        .unwrap();
    const BACKLOG: u64 = 300;
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut sel = naam_proto::steering::Selector::default();
    for id in 1..=BACKLOG {
        let req = Request::for_call(HOG, handler_id("spin"), id, &[], &[]).unwrap();
        let d = done.clone();
        let queued = c.dispatch(req, &mut sel, Some(Placement::Host), move |_| {
            d.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        assert!(matches!(
            queued,
            naam_proto::endpoint::Routed::Queued(Placement::Host)
        ));
    }
    let mut client = c.client();
    for _ in 0..5 {
        let r = client
            .call_at(
                Placement::Host,
                APP,
                handler_id("add"),
                &words(&[1, 2]),
                &[],
            )
            .unwrap();
        assert_eq!(r.status, Status::Ok);
    }
    let hog_done = done.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        hog_done < BACKLOG / 2,
        "five cheap messages waited for {hog_done} of the other app's {BACKLOG}"
    );
}

/// A message a thread runs itself (`dispatch_here`, as naam-server's loops and the inline
/// server run reads) books its steps against its app's budget once, in the thread's
/// periodic report; they were also booked at the run, twice in all, so an app was refused at
/// half its budget.
#[test]
fn steps_of_messages_run_here_count_once_against_the_budget() {
    use naam_proto::endpoint::Routed;
    use naam_proto::steering::Selector;
    use naam_proto::wire::Reply;
    use naam_runtime::cluster::TenantBudget;
    let probe = cluster(ClusterConfig::functional());
    let run = |c: &Cluster, runner: &mut naam_runtime::cluster::HereRunner, id: u64| {
        let sorted = c.region_key(APP, "sorted").unwrap();
        let mut req = Request::for_call(
            APP,
            handler_id("bsearch"),
            id,
            &words(&[3]),
            &[rd(sorted, 0, 4096)],
        )
        .unwrap();
        let mut sel = Selector::default();
        let mut out = Reply::unanswered();
        let routed = c.dispatch_here(
            runner,
            &mut req,
            &mut sel,
            Some(Placement::Host),
            || |_: Reply| {},
            &mut out,
        );
        let r = match routed {
            Routed::Answered => {
                // Answered at once: the request stays with the caller, as it was, and the
                // reply is where the caller keeps it.
                assert_eq!((req.request_id, &req.args[..]), (id, &words(&[3])[..]));
                assert_eq!(out.request_id, id);
                out
            }
            Routed::Refused(r) => r,
            other => panic!("neither run nor refused: {other:?}"),
        };
        (r.status, u64::from(r.steps))
    };
    let mut runner = probe.here_runner(Placement::Host);
    let (status, steps) = run(&probe, &mut runner, 1);
    assert_eq!(status, Status::Ok);
    assert!(steps > 0);

    let mut config = ClusterConfig::functional();
    config.tenant_budget = TenantBudget {
        period: Duration::from_secs(3600),
        retries: 1_000,
        steps: 10 * steps,
    };
    let c = cluster(config);
    let mut runner = c.here_runner(Placement::Host);
    for id in 1..=6 {
        assert_eq!(run(&c, &mut runner, id).0, Status::Ok);
    }
    runner.flush(&c);
    // Six messages' steps of ten spent (twelve, when they were booked twice).
    assert_eq!(run(&c, &mut runner, 7).0, Status::Ok, "refused at 6 of 10");
    for id in 8..=10 {
        assert_eq!(run(&c, &mut runner, id).0, Status::Ok);
    }
    runner.flush(&c);
    assert_eq!(
        run(&c, &mut runner, 11).0,
        Status::Busy,
        "ten messages' steps spent the budget"
    );
    assert_eq!(run(&c, &mut runner, 12).0, Status::Busy);
    // The accounting: one period exhausted (not one per refusal), handler time at the host.
    let account = c.app_accounts().into_iter().find(|a| a.app == APP).unwrap();
    assert_eq!((account.steps_exhausted, account.retries_exhausted), (1, 0));
    assert!(account.cpu_ns[Placement::Host.index()] > 0, "{account:?}");
    assert_eq!(account.cpu_ns[Placement::Nic.index()], 0);
}

/// The eSwitch's sync writes only what moved: changes are kept once someone takes them, a
/// static policy moves nothing, and the shares of a few handlers are those of the whole.
#[test]
fn weight_changes_are_kept_once_taken_and_a_static_policy_moves_none() {
    let mut config = ClusterConfig::functional();
    config.policy = PolicyChoice::Always(Placement::Nic);
    let c = cluster(config);
    assert_eq!(
        c.take_weight_changes(),
        None,
        "the first take starts the keeping"
    );
    let mut client = c.client();
    for _ in 0..50 {
        client
            .call(APP, handler_id("add"), &words(&[1, 1]), &[])
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    let changes = c.take_weight_changes().expect("changes are kept now");
    assert!(changes.is_empty(), "a static policy moved {changes:?}");
    let all = c.eswitch_shares(None);
    let add = c.eswitch_shares_of(&[(APP, handler_id("add")), (APP, 0xdead)], None);
    assert_eq!(
        add.len(),
        1,
        "one read handler, and no entry for one that does not exist"
    );
    assert!(all.contains(&add[0]));
}
