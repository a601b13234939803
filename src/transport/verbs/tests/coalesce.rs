//! Coalesced registrations (`regions.rs`) on the simulated NIC: views of one
//! allocation registered as a list share one MR; each keeps its own key and
//! bounds; data moves through the shared MR; the MR goes with the last view.
//!
//! The simulated MR of a run is sim memory at the run's own addresses
//! (`SimFabric::alloc_at`), so the real host buffers only lend addresses.

use std::sync::Arc;

use super::sim_harness::{Opts, PAGE, Pair, typed};
use crate::transport::verbs::regions::{Keys, Regions, Run};
use crate::transport::verbs::sim::SimFabric;
use crate::transport::{LocalKey, MemoryBacking, Op, PostRequest, RemoteKey, Segment, TransportError, View, XferId};

/// A simulated MR: deregistered (dealloc'd) when dropped.
struct SimMr {
    fabric: SimFabric,
    key: u32,
}

impl Drop for SimMr {
    fn drop(&mut self) {
        self.fabric.dealloc(self.key);
    }
}

fn sim_make(fabric: &SimFabric, dev: u32) -> impl FnMut(&Run<'_>) -> Result<(SimMr, u32, u32), TransportError> + '_ {
    move |r| {
        let key = fabric.alloc_at(dev, r.desc.addr, r.desc.len_bytes as usize);
        Ok((SimMr { fabric: fabric.clone(), key }, key, key))
    }
}

/// 16 page views of one 64 KiB host buffer (the buffer, the views).
fn views() -> (Arc<dyn MemoryBacking>, Vec<Arc<dyn MemoryBacking>>) {
    let buf: Arc<dyn MemoryBacking> = Arc::new(crate::HostBuffer::new(16 * PAGE as usize).unwrap());
    let v = (0..16).map(|i| Arc::new(View::new(buf.clone(), i * PAGE, PAGE).unwrap()) as Arc<dyn MemoryBacking>);
    (buf.clone(), v.collect())
}

/// A WRITE of page `i` of each `(view, key)` to the same offset of the
/// target's region, resolved through the table.
fn write_views(
    p: &mut Pair,
    t: &Regions<SimMr>,
    x: u64,
    parts: &[(&Arc<dyn MemoryBacking>, Keys)],
    base: u64,
) -> Result<(), TransportError> {
    let mut segments: Vec<Segment> = parts
        .iter()
        .map(|(v, k)| {
            let d = v.desc();
            Segment {
                local_addr: d.addr,
                lkey: k.lkey,
                remote_addr: p.dst.0 + (d.addr - base),
                rkey: RemoteKey(p.dst.1),
                len_bytes: d.len_bytes,
            }
        })
        .collect();
    t.resolve(&mut segments)?;
    let req = PostRequest { xfer: XferId(x), op: Op::Write, peer: p.peer, segments, notification: None };
    let (qpns, limits) = (typed(&p.qpns), p.limits);
    p.i.st.post(&req, &qpns, "target", &limits)
}

#[test]
fn views_share_one_mr_and_data_moves_through_it() {
    let mut p = Pair::new(11, Opts::default());
    let (buf, v) = views();
    let base = buf.desc().addr;
    let fabric = p.fabric.clone();
    let mut t = Regions::new(true);
    let keys = t.register_batch(v.clone(), sim_make(&fabric, 0)).unwrap();
    assert_eq!(t.memory_regions(), 1, "16 views of one buffer: one MR");
    let hw = t.hw_lkey(keys[0].lkey.0).unwrap();
    assert!(keys.iter().all(|k| t.hw_lkey(k.lkey.0) == Some(hw) && k.rkey == hw));
    let data: Vec<u8> = (0..16 * PAGE as usize).map(|i| (i * 7 % 251) as u8).collect();
    assert!(fabric.write(hw, base, &data));
    let parts: Vec<_> = v.iter().zip(keys.iter().copied()).collect();
    write_views(&mut p, &t, 1, &parts, base).unwrap();
    p.run();
    assert_eq!(p.result(1), Some(Ok(())));
    assert_eq!(&p.dst_bytes()[..data.len()], &data[..], "every view's page landed");
}

#[test]
fn bounds_are_those_of_the_registration_not_of_the_mr() {
    let mut p = Pair::new(12, Opts::default());
    let (buf, v) = views();
    let base = buf.desc().addr;
    let fabric = p.fabric.clone();
    let mut t = Regions::new(true);
    let keys = t.register_batch(v.clone(), sim_make(&fabric, 0)).unwrap();
    // View 3's key with view 4's page: inside the MR, outside view 3.
    let next_page = &v[4];
    let r = write_views(&mut p, &t, 1, &[(next_page, keys[3])], base);
    assert!(matches!(r, Err(TransportError::LocalOutOfBounds { lkey, .. }) if lkey == keys[3].lkey), "got {r:?}");
    // Spanning two abutting views under one key is refused too.
    let two: Arc<dyn MemoryBacking> = Arc::new(View::new(buf.clone(), 3 * PAGE, 2 * PAGE).unwrap());
    assert!(matches!(
        write_views(&mut p, &t, 2, &[(&two, keys[3])], base),
        Err(TransportError::LocalOutOfBounds { .. })
    ));
    // An unknown key, and the MR's hardware lkey used as a registration key
    // (keys are the table's, not the NIC's).
    let bogus = Keys { lkey: LocalKey(9999), rkey: 0 };
    assert!(matches!(write_views(&mut p, &t, 3, &[(&v[0], bogus)], base), Err(TransportError::UnknownLocalKey(_))));
    p.run();
    assert_eq!(p.result(1), None, "nothing was posted");
}

#[test]
fn deregister_in_any_order_keeps_the_mr_until_the_last_view() {
    let mut p = Pair::new(13, Opts::default());
    let (buf, v) = views();
    let base = buf.desc().addr;
    let fabric = p.fabric.clone();
    let mut t = Regions::new(true);
    let keys = t.register_batch(v.clone(), sim_make(&fabric, 0)).unwrap();
    let hw = t.hw_lkey(keys[0].lkey.0).unwrap();
    let order = [5usize, 0, 15, 9, 2, 12, 7, 1, 14, 3, 10, 6, 13, 4, 11];
    for (n, &i) in order.iter().enumerate() {
        t.deregister(keys[i].lkey).unwrap();
        // The deregistered view is refused; the last one still moves data.
        assert!(matches!(
            write_views(&mut p, &t, 100 + n as u64, &[(&v[i], keys[i])], base),
            Err(TransportError::UnknownLocalKey(_))
        ));
        let x = 200 + n as u64;
        write_views(&mut p, &t, x, &[(&v[8], keys[8])], base).unwrap();
        p.run();
        assert_eq!(p.result(x), Some(Ok(())));
        assert!(fabric.read(hw, base, 1).is_some(), "MR still registered");
    }
    t.deregister(keys[8].lkey).unwrap();
    assert_eq!(t.memory_regions(), 0);
    assert!(fabric.read(hw, base, 1).is_none(), "the last view took the MR with it");
    // A WR still naming the old hardware lkey fails at the NIC.
    let seg = Segment {
        local_addr: base,
        lkey: LocalKey(hw),
        remote_addr: p.dst.0,
        rkey: RemoteKey(p.dst.1),
        len_bytes: PAGE,
    };
    let req = PostRequest { xfer: XferId(9), op: Op::Write, peer: p.peer, segments: vec![seg], notification: None };
    let (qpns, limits) = (typed(&p.qpns), p.limits);
    p.i.st.post(&req, &qpns, "target", &limits).unwrap();
    p.run();
    assert!(matches!(p.result(9), Some(Err(_))));
}

/// The documented cost of coalescing (docs/SECURITY.md): the target's NIC
/// checks the rkey against the MR, so a deregistered view stays reachable
/// through the shared rkey while a sibling lives; with coalescing off it is
/// not.
#[test]
fn deregistered_view_stays_reachable_through_the_shared_rkey_unless_coalescing_is_off() {
    for coalesce in [true, false] {
        let mut p = Pair::new(14, Opts::default());
        let (buf, v) = views();
        let fabric = p.fabric.clone();
        // The target's registrations are the views (on device 1).
        let mut target = Regions::new(coalesce);
        let keys = target.register_batch(v.clone(), sim_make(&fabric, 1)).unwrap();
        assert_eq!(target.memory_regions(), if coalesce { 1 } else { 16 });
        target.deregister(keys[2].lkey).unwrap();
        // A WRITE into view 2's bytes with view 2's old rkey.
        let seg = Segment {
            local_addr: p.src.0,
            lkey: LocalKey(p.src.1),
            remote_addr: v[2].desc().addr,
            rkey: RemoteKey(keys[2].rkey),
            len_bytes: PAGE,
        };
        let req = PostRequest { xfer: XferId(1), op: Op::Write, peer: p.peer, segments: vec![seg], notification: None };
        let (qpns, limits) = (typed(&p.qpns), p.limits);
        p.i.st.post(&req, &qpns, "target", &limits).unwrap();
        p.run();
        assert_eq!(p.result(1).unwrap().is_ok(), coalesce, "coalesce={coalesce}");
        drop(buf);
    }
}

/// Overlapping registrations, accepted as NIXL 1.5.1 accepts them (issue 29
/// item 2): a later single registration overlapping a live MR without lying
/// inside it gets an MR of its own over the shared pages; an identical one
/// shares the MR; a list of overlapping ranges shares one MR. Each keeps its
/// own bounds (a range across both, inside neither, is refused under either
/// key), data moves through each, and each MR goes with its last
/// registration, whichever goes first.
#[test]
fn overlapping_registrations_keep_their_own_bounds_and_mrs() {
    for first_out in [0usize, 1] {
        let mut p = Pair::new(15 + first_out as u64, Opts::default());
        let (buf, _) = views();
        let base = buf.desc().addr;
        let fabric = p.fabric.clone();
        let view = |first: u64, n: u64| -> Arc<dyn MemoryBacking> {
            Arc::new(View::new(buf.clone(), first * PAGE, n * PAGE).unwrap())
        };
        let mut t = Regions::new(true);
        // Pages [0, 10), then [6, 16): one call each, two MRs.
        let kx = t.register_batch(vec![view(0, 10)], sim_make(&fabric, 0)).unwrap()[0];
        let ky = t.register_batch(vec![view(6, 10)], sim_make(&fabric, 0)).unwrap()[0];
        assert_eq!(t.memory_regions(), 2);
        let (hx, hy) = (t.hw_lkey(kx.lkey.0).unwrap(), t.hw_lkey(ky.lkey.0).unwrap());
        assert_ne!(hx, hy);
        // [0, 10) again: inside the first MR, so it shares it.
        let kx2 = t.register_batch(vec![view(0, 10)], sim_make(&fabric, 0)).unwrap()[0];
        assert_eq!((t.memory_regions(), t.hw_lkey(kx2.lkey.0)), (2, Some(hx)));
        assert_ne!(kx2.lkey, kx.lkey, "each registration keeps its own key");
        // The simulated MRs hold bytes of their own: give both the pattern.
        let data: Vec<u8> = (0..16 * PAGE as usize).map(|i| (i * 13 % 251) as u8).collect();
        let pg = PAGE as usize;
        assert!(fabric.write(hx, base, &data[..10 * pg]));
        assert!(fabric.write(hy, base + 6 * PAGE, &data[6 * pg..]));
        // Each one's own pages, and the shared pages under either key.
        let (own_x, own_y, shared) = (view(0, 6), view(10, 6), view(6, 4));
        write_views(&mut p, &t, 1, &[(&own_x, kx), (&own_y, ky)], base).unwrap();
        write_views(&mut p, &t, 2, &[(&shared, kx)], base).unwrap();
        p.run();
        assert_eq!((p.result(1), p.result(2)), (Some(Ok(())), Some(Ok(()))));
        assert_eq!(p.dst_bytes()[..data.len()], data[..], "every page landed");
        p.fill_dst(|_| 0);
        write_views(&mut p, &t, 3, &[(&shared, ky)], base).unwrap();
        p.run();
        assert_eq!(p.result(3), Some(Ok(())));
        assert_eq!(p.dst_bytes()[6 * pg..10 * pg], data[6 * pg..10 * pg]);
        // Across both, inside neither: refused under either key.
        let across = view(4, 8);
        for k in [kx, ky, kx2] {
            let r = write_views(&mut p, &t, 4, &[(&across, k)], base);
            assert!(matches!(r, Err(TransportError::LocalOutOfBounds { .. })), "got {r:?}");
        }
        // One goes: the other's MR stays, with the shared pages; the MR of
        // the one that went stays while its identical twin lives.
        let (gone, stays, h_stays) = if first_out == 0 { (kx, ky, hy) } else { (ky, kx, hx) };
        t.deregister(gone.lkey).unwrap();
        // [6, 16) had its MR alone; [0, 10)'s is still held by the twin.
        assert_eq!(t.memory_regions(), if first_out == 0 { 2 } else { 1 }, "first_out={first_out}");
        write_views(&mut p, &t, 5, &[(&shared, stays)], base).unwrap();
        p.run();
        assert_eq!(p.result(5), Some(Ok(())));
        assert!(matches!(
            write_views(&mut p, &t, 6, &[(&shared, gone)], base),
            Err(TransportError::UnknownLocalKey(_))
        ));
        t.deregister(kx2.lkey).unwrap();
        assert_eq!(t.memory_regions(), 1, "first_out={first_out}");
        assert_eq!(fabric.read(hx, base, 1).is_some(), first_out == 1);
        assert!(fabric.read(h_stays, base + 6 * PAGE, 1).is_some());
        t.deregister(stays.lkey).unwrap();
        assert_eq!(t.memory_regions(), 0);
        assert!(fabric.read(hx, base, 1).is_none() && fabric.read(hy, base + 6 * PAGE, 1).is_none());
        // As one list, overlapping ranges share one MR covering their union.
        let both = t.register_batch(vec![view(6, 10), view(0, 10)], sim_make(&fabric, 0)).unwrap();
        assert_eq!(t.memory_regions(), 1);
        let (_, _, mr) = t.mr_of(both[0].lkey.0).unwrap();
        assert_eq!((mr.addr, mr.len_bytes), (base, 16 * PAGE));
    }
}
