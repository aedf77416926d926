//! HTTP/2 frames written and read by hand, for clients that misbehave in ways
//! h2's client will not: frame layout from RFC 9113 §4.1 (a 9-byte header: 24-bit
//! length, type, flags, 31-bit stream id), types and flags from §6, error codes
//! from §7, header blocks as HPACK literals (RFC 7541 §6.2).

use tokio::io::{AsyncRead, AsyncReadExt};

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const WINDOW_UPDATE: u8 = 0x8;
pub const CONTINUATION: u8 = 0x9;

pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const ACK: u8 = 0x1;

/// `SETTINGS_INITIAL_WINDOW_SIZE` (RFC 9113 §6.5.2).
pub const INITIAL_WINDOW_SIZE: u16 = 0x4;

pub const NO_ERROR: u32 = 0x0;
pub const REFUSED_STREAM: u32 = 0x7;
pub const CANCEL: u32 = 0x8;
pub const ENHANCE_YOUR_CALM: u32 = 0xb;

/// The largest flow-control window (RFC 9113 §6.9.1).
pub const MAX_WINDOW: u32 = (1 << 31) - 1;

/// Appends one frame to `buf`.
pub fn frame(buf: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = u32::try_from(payload.len()).unwrap();
    assert!(len < 1 << 24, "a frame's length has 24 bits");
    buf.extend_from_slice(&len.to_be_bytes()[1..]);
    buf.push(kind);
    buf.push(flags);
    buf.extend_from_slice(&stream.to_be_bytes());
    buf.extend_from_slice(payload);
}

/// The preface and a SETTINGS frame of `settings` (identifier, value).
pub fn preface(settings: &[(u16, u32)]) -> Vec<u8> {
    let mut buf = PREFACE.to_vec();
    let mut payload = Vec::new();
    for (id, value) in settings {
        payload.extend_from_slice(&id.to_be_bytes());
        payload.extend_from_slice(&value.to_be_bytes());
    }
    frame(&mut buf, SETTINGS, 0, 0, &payload);
    buf
}

/// An HPACK integer (RFC 7541 §5.1) with an `n`-bit prefix, the bits above
/// it `flags`.
pub fn hpack_int(buf: &mut Vec<u8>, n: u8, flags: u8, value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        buf.push(flags | value as u8);
        return;
    }
    buf.push(flags | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        buf.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    buf.push(rest as u8);
}

/// A literal string, not Huffman-coded (RFC 7541 §5.2).
pub fn hpack_str(buf: &mut Vec<u8>, s: &[u8]) {
    hpack_int(buf, 7, 0, s.len());
    buf.extend_from_slice(s);
}

/// The header block of `CONNECT authority`: two literals without indexing whose
/// names are static table entries 2 (`:method`) and 1 (`:authority`) (RFC 7541
/// §6.2.2, Appendix A).
pub fn connect_block(authority: &str) -> Vec<u8> {
    let mut block = Vec::new();
    hpack_int(&mut block, 4, 0, 2);
    hpack_str(&mut block, b"CONNECT");
    hpack_int(&mut block, 4, 0, 1);
    hpack_str(&mut block, authority.as_bytes());
    block
}

/// A header field `name: value` as a literal with a new name, without indexing.
pub fn literal(block: &mut Vec<u8>, name: &str, value: &[u8]) {
    block.push(0);
    hpack_str(block, name.as_bytes());
    hpack_str(block, value);
}

/// A header field `name: value` as a literal with a new name that the decoder
/// adds to its dynamic table (RFC 7541 §6.2.1): the first entry after the 61
/// static ones, index 62, until another is added.
pub fn indexed_literal(block: &mut Vec<u8>, name: &str, value: &[u8]) {
    block.push(0x40);
    hpack_str(block, name.as_bytes());
    hpack_str(block, value);
}

/// A header field by its index (RFC 7541 §6.1).
pub fn indexed(block: &mut Vec<u8>, index: usize) {
    hpack_int(block, 7, 0x80, index);
}

/// A frame as read.
#[derive(Debug)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    /// The error code of a GOAWAY (§6.8) or RST_STREAM (§6.4).
    pub fn error_code(&self) -> Option<u32> {
        let at = match self.kind {
            GOAWAY => 4,
            RST_STREAM => 0,
            _ => return None,
        };
        let code = self.payload.get(at..at + 4)?;
        Some(u32::from_be_bytes(code.try_into().unwrap()))
    }
}

/// Reads the next frame; `None` at the end of the connection (or on an error
/// reading it: the server reset it).
pub async fn read_frame(r: &mut (impl AsyncRead + Unpin)) -> Option<Frame> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head).await.ok()?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await.ok()?;
    Some(Frame {
        kind: head[3],
        flags: head[4],
        stream: u32::from_be_bytes(head[5..9].try_into().unwrap()) & 0x7fff_ffff,
        payload,
    })
}

/// How a connection ended for its client.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// The server sent GOAWAY with this error code (and then closed it, or not).
    GoAway(u32),
    /// Closed or reset without a GOAWAY.
    Closed,
}

/// Reads frames until a GOAWAY or the end of the connection; each frame before
/// goes to `seen`.
pub async fn read_until_end(r: &mut (impl AsyncRead + Unpin), mut seen: impl FnMut(&Frame)) -> End {
    while let Some(f) = read_frame(r).await {
        if f.kind == GOAWAY {
            return End::GoAway(f.error_code().unwrap_or(u32::MAX));
        }
        seen(&f);
    }
    End::Closed
}
