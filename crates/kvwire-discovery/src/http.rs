//! A minimal HTTP/1.1 client for etcd's JSON gateway: `POST` a JSON body to
//! a plain `http://` endpoint, then read the answer as one message
//! (`Content-Length`) or as newline-separated JSON messages (chunked
//! streams: `watch`, `lease/keepalive`). Every length is bounded; no TLS.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use super::DiscoveryError;

/// Largest message or header block accepted (bytes).
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;
/// Longest header or chunk-size line (bytes).
const MAX_LINE_BYTES: usize = 8 << 10;

fn io(call: &'static str) -> impl Fn(std::io::Error) -> DiscoveryError {
    move |source| DiscoveryError::Io { call, source }
}

/// An endpoint: `host:port` from `http://host:port[/]`.
///
/// # Errors
/// [`DiscoveryError::BadUrl`] for another scheme or a path.
pub fn parse_endpoint(url: &str) -> Result<String, DiscoveryError> {
    let rest = url
        .trim()
        .strip_prefix("http://")
        .ok_or_else(|| DiscoveryError::BadUrl(format!("{url:?}: only http:// endpoints are supported")))?;
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest.contains('/') {
        return Err(DiscoveryError::BadUrl(format!("{url:?}: expected http://host:port")));
    }
    Ok(if rest.contains(':') { rest.to_string() } else { format!("{rest}:2379") })
}

/// An answer being read.
pub struct Response {
    reader: BufReader<TcpStream>,
    chunked: bool,
    /// Bytes left in the body (`Content-Length`) or current chunk.
    left: usize,
    done: bool,
    pending: Vec<u8>,
}

/// `POST` `body` to `path` on `endpoint`; returns once the status line and
/// headers are read. Each socket operation is bounded by `timeout`.
///
/// # Errors
/// [`DiscoveryError::Io`], [`DiscoveryError::Http`] for a status other than
/// 200 (with the start of the body), [`DiscoveryError::Protocol`].
pub fn post(endpoint: &str, path: &str, body: &str, timeout: Duration) -> Result<Response, DiscoveryError> {
    let addr = endpoint
        .to_socket_addrs()
        .map_err(io("resolve"))?
        .next()
        .ok_or_else(|| DiscoveryError::BadUrl(format!("{endpoint} resolves to nothing")))?;
    let sock = TcpStream::connect_timeout(&addr, timeout).map_err(io("connect"))?;
    sock.set_read_timeout(Some(timeout)).map_err(io("setsockopt(SO_RCVTIMEO)"))?;
    sock.set_write_timeout(Some(timeout)).map_err(io("setsockopt(SO_SNDTIMEO)"))?;
    sock.set_nodelay(true).map_err(io("setsockopt(TCP_NODELAY)"))?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    (&sock).write_all(req.as_bytes()).map_err(io("send"))?;
    let mut reader = BufReader::new(sock);
    let status_line = read_line(&mut reader)?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| DiscoveryError::Protocol(format!("bad status line {status_line:?}")))?;
    let (mut chunked, mut length, mut header_bytes) = (false, None, 0usize);
    loop {
        let line = read_line(&mut reader)?;
        header_bytes += line.len();
        if header_bytes > MAX_LINE_BYTES * 4 {
            return Err(DiscoveryError::Protocol("response headers too large".into()));
        }
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else { continue };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        if name == "transfer-encoding" && value.eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if name == "content-length" {
            let n: usize =
                value.parse().map_err(|_| DiscoveryError::Protocol(format!("bad Content-Length {value}")))?;
            if n > MAX_MESSAGE_BYTES {
                return Err(DiscoveryError::Protocol(format!("{n}-byte response exceeds the limit")));
            }
            length = Some(n);
        }
    }
    let mut resp = Response { reader, chunked, left: length.unwrap_or(0), done: false, pending: Vec::new() };
    if !chunked && length.is_none() {
        return Err(DiscoveryError::Protocol("response without length or chunking".into()));
    }
    if status != 200 {
        let body = resp.next_message()?.unwrap_or_default();
        let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
        return Err(DiscoveryError::Http { status, body: text });
    }
    Ok(resp)
}

fn read_line(r: &mut BufReader<TcpStream>) -> Result<String, DiscoveryError> {
    let mut line = Vec::new();
    let n = r.by_ref().take(MAX_LINE_BYTES as u64).read_until(b'\n', &mut line).map_err(io("recv"))?;
    if n == 0 {
        return Err(DiscoveryError::Protocol("connection closed in the headers".into()));
    }
    if line.last() != Some(&b'\n') {
        return Err(DiscoveryError::Protocol("header line too long".into()));
    }
    let s = String::from_utf8_lossy(&line);
    Ok(s.trim_end_matches(['\r', '\n']).to_string())
}

impl Response {
    /// The next message: the whole body of a `Content-Length` answer, or the
    /// next newline-terminated JSON message of a chunked stream. `None` at
    /// the end of the body.
    ///
    /// # Errors
    /// [`DiscoveryError::Io`] (including a read timeout),
    /// [`DiscoveryError::Protocol`] for a malformed or oversized stream.
    pub fn next_message(&mut self) -> Result<Option<Vec<u8>>, DiscoveryError> {
        if !self.chunked {
            if self.done {
                return Ok(None);
            }
            let mut body = vec![0u8; self.left];
            self.reader.read_exact(&mut body).map_err(io("recv"))?;
            self.done = true;
            return Ok(Some(body));
        }
        loop {
            if let Some(pos) = self.pending.iter().position(|&b| b == b'\n') {
                let mut msg: Vec<u8> = self.pending.drain(..=pos).collect();
                msg.pop();
                if msg.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Ok(Some(msg));
            }
            if self.done {
                if self.pending.iter().all(u8::is_ascii_whitespace) {
                    return Ok(None);
                }
                return Ok(Some(std::mem::take(&mut self.pending)));
            }
            self.read_chunk()?;
        }
    }

    fn read_chunk(&mut self) -> Result<(), DiscoveryError> {
        if self.left == 0 {
            let line = read_line(&mut self.reader)?;
            let size = line.split(';').next().unwrap_or("").trim();
            let n = usize::from_str_radix(size, 16)
                .map_err(|_| DiscoveryError::Protocol(format!("bad chunk size {line:?}")))?;
            if n == 0 {
                self.done = true;
                return Ok(());
            }
            if n > MAX_MESSAGE_BYTES {
                return Err(DiscoveryError::Protocol(format!("{n}-byte chunk exceeds the limit")));
            }
            self.left = n;
        }
        if self.pending.len() + self.left > MAX_MESSAGE_BYTES {
            return Err(DiscoveryError::Protocol("message exceeds the limit".into()));
        }
        let start = self.pending.len();
        self.pending.resize(start + self.left, 0);
        self.reader.read_exact(&mut self.pending[start..]).map_err(io("recv"))?;
        self.left = 0;
        let mut crlf = [0u8; 2];
        self.reader.read_exact(&mut crlf).map_err(io("recv"))?;
        Ok(())
    }

    /// Shut the connection down (ends a stream early).
    pub fn close(&self) {
        let _ = self.reader.get_ref().shutdown(std::net::Shutdown::Both);
    }

    /// A handle that can shut the connection down from another thread.
    ///
    /// # Errors
    /// `dup` failure.
    pub fn closer(&self) -> Result<TcpStream, DiscoveryError> {
        self.reader.get_ref().try_clone().map_err(io("dup"))
    }
}

/// Standard base64 (RFC 4648, with padding) as etcd's gateway (Go's
/// `encoding/base64.StdEncoding`) writes and reads it: padding required,
/// unused trailing bits ignored.
const B64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new().with_decode_allow_trailing_bits(true),
);

/// Standard base64 (RFC 4648, with padding), as etcd's gateway encodes bytes.
pub fn b64encode(data: &[u8]) -> String {
    base64::Engine::encode(&B64, data)
}

/// Decode standard base64; `None` when malformed.
pub fn b64decode(text: &str) -> Option<Vec<u8>> {
    base64::Engine::decode(&B64, text).ok()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn base64_matches_known_vectors() {
        for (raw, enc) in
            [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foob", "Zm9vYg=="), ("fooba", "Zm9vYmE=")]
        {
            assert_eq!(b64encode(raw.as_bytes()), enc);
            assert_eq!(b64decode(enc).unwrap(), raw.as_bytes());
        }
        assert!(b64decode("Zm9").is_none());
        assert!(b64decode("Z===").is_none());
        assert!(b64decode("Zm9*").is_none());
        assert!(b64decode("Zg=").is_none());
        assert!(b64decode("Zg==Zg==").is_none());
        assert!(b64decode("Zm9v\n").is_none());
        // Unused trailing bits are ignored, as Go's StdEncoding does.
        assert_eq!(b64decode("Zh==").unwrap(), b"f");
    }

    proptest! {
        #[test]
        fn base64_round_trips(data in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assert_eq!(b64decode(&b64encode(&data)), Some(data));
        }

        #[test]
        fn base64_decoder_never_panics(text in "[A-Za-z0-9+/=*]{0,40}") {
            let _ = b64decode(&text);
        }
    }

    #[test]
    fn endpoints_parse() {
        assert_eq!(parse_endpoint("http://127.0.0.1:2379").unwrap(), "127.0.0.1:2379");
        assert_eq!(parse_endpoint("http://etcd/").unwrap(), "etcd:2379");
        assert!(parse_endpoint("https://x:1").is_err());
        assert!(parse_endpoint("http://x:1/v3").is_err());
    }
}
