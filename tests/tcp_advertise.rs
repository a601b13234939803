//! The address a tcp agent publishes must be one a peer can reach: the
//! listen address given, or, listening on 0.0.0.0, a non-loopback address
//! of this host (never loopback unless it listens only there).

mod tcp_util;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kvwire::HostBuffer;
use kvwire::engine::{Desc, TransferEngine, TransferStatus};
use kvwire::transport::tcp::{TcpConnectionInfo, TcpTransport, reachable_ip};
use kvwire::transport::{Op, Transport, TransportConfig, TransportKind};

fn opts(pairs: &[(&str, &str)]) -> TransportConfig {
    TransportConfig {
        peer_timeout: Duration::from_secs(2),
        options: pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        ..Default::default()
    }
}

fn advertised(t: &dyn Transport) -> SocketAddr {
    TcpConnectionInfo::decode(&t.connection_info()).unwrap().addr.parse().unwrap()
}

#[test]
fn an_engine_listening_on_0_0_0_0_advertises_a_reachable_non_loopback_address() {
    let Some(ip) = reachable_ip(false) else {
        eprintln!("skipped: this host has no non-loopback IPv4 address (creation must then fail)");
        assert!(TcpTransport::new("t", &opts(&[("listen", "0.0.0.0:0")])).is_err());
        return;
    };
    assert!(!ip.is_loopback() && !ip.is_unspecified());
    if std::env::var_os("KVWIRE_TCP_LISTEN").is_none() {
        // Cross-host by default: no listen option, a reachable address.
        let d = TcpTransport::new("default", &opts(&[])).unwrap();
        assert_eq!(advertised(&d).ip(), ip, "the default listener advertises the reachable address");
    }
    let mut target = TransferEngine::new("decode", TransportKind::Tcp, &opts(&[("listen", "0.0.0.0:0")])).unwrap();
    let meta = target.metadata();
    let info = TcpConnectionInfo::decode(&meta.connection_info).unwrap();
    let addr: SocketAddr = info.addr.parse().unwrap();
    assert_eq!(addr.ip(), ip, "the advertised address is this host's reachable address");
    assert!(!addr.ip().is_loopback() && !addr.ip().is_unspecified(), "advertised {addr}");
    assert_ne!(addr.port(), 0);
    // A peer really reaches it there.
    let mut init = TransferEngine::new("prefill", TransportKind::Tcp, &opts(&[])).unwrap();
    let src = Arc::new(HostBuffer::new(1 << 16).unwrap());
    let dst = Arc::new(HostBuffer::new(1 << 16).unwrap());
    src.fill_with(0, src.len(), |i| (i % 13) as u8);
    init.register(src.clone()).unwrap();
    target.register(dst.clone()).unwrap();
    init.connect(&target.metadata()).unwrap();
    let h =
        init.post(Op::Write, &[Desc::new(src.addr(), 8192)], "decode", &[Desc::new(dst.addr(), 8192)], None).unwrap();
    let t0 = std::time::Instant::now();
    while init.status(h).unwrap() == TransferStatus::InProgress && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(init.status(h).unwrap(), TransferStatus::Done);
    assert_eq!(dst.to_vec(..8192), src.to_vec(..8192));
}

#[test]
fn a_loopback_listener_advertises_loopback_and_advertise_overrides() {
    let t = TcpTransport::new("a", &opts(&[("listen", "127.0.0.1:0")])).unwrap();
    let a = advertised(&t);
    assert!(a.ip().is_loopback() && a.port() != 0);
    // A bare IP takes the listener's port.
    let t = TcpTransport::new("b", &opts(&[("listen", "127.0.0.1:0"), ("advertise", "127.0.0.2")])).unwrap();
    let b = advertised(&t);
    assert_eq!(b.ip(), "127.0.0.2".parse::<IpAddr>().unwrap());
    assert_eq!(b.port(), t.listen_addr().rsplit(':').next().unwrap().parse::<u16>().unwrap());
    let t = TcpTransport::new("c", &opts(&[("listen", "127.0.0.1:0"), ("advertise", "10.1.2.3:7000")])).unwrap();
    assert_eq!(advertised(&t).to_string(), "10.1.2.3:7000");
}
