//! RESP2/RESP3 on the wire, with no IO: a request parser that cuts commands out of a
//! connection's input buffer without copying their arguments, a parser of any RESP frame
//! (replies, in tests and in clients), and the encoders the front writes its replies with.
//!
//! Every length a peer sends is checked against [`Limits`] before anything is reserved for it,
//! so a hostile `*2147483647` or `$999999999` costs nothing but an error.

use std::ops::Range;

use bytes::Bytes;

/// What a request may be at most; a larger one is a protocol error, which closes the
/// connection (as Redis does for `proto-max-bulk-len`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest bulk string, bytes.
    pub max_bulk: usize,
    /// The most arguments in one command (the command's name included).
    pub max_args: usize,
    /// The longest inline command (a line not starting with `*`), bytes.
    pub max_inline: usize,
    /// The deepest nesting of aggregates [`parse_frame`] accepts.
    pub max_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bulk: 1 << 20,
            max_args: 1 << 16,
            max_inline: 64 << 10,
            max_depth: 32,
        }
    }
}

/// Why bytes are not RESP. The connection that sent them is closed after the error is sent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A byte where a type marker or a digit should be.
    #[error("Protocol error: expected '{expected}', got '{}' at byte {at}", escape(*found))]
    Unexpected {
        /// What the grammar allows there.
        expected: &'static str,
        /// The byte found.
        found: u8,
        /// Its offset from the start of the frame.
        at: usize,
    },
    /// A length or an integer that is not a decimal number in range.
    #[error("Protocol error: invalid {what} at byte {at}")]
    BadNumber {
        /// Which number (`multibulk length`, `bulk length`, `integer`).
        what: &'static str,
        /// Its offset from the start of the frame.
        at: usize,
    },
    /// A length over the configured limit.
    #[error("Protocol error: {what} {len} over the limit of {limit}")]
    TooLarge {
        /// Which length.
        what: &'static str,
        /// The length sent.
        len: u64,
        /// The limit.
        limit: usize,
    },
    /// Aggregates nested deeper than [`Limits::max_depth`].
    #[error("Protocol error: aggregates nested deeper than {limit}")]
    TooDeep {
        /// The limit.
        limit: usize,
    },
    /// A bulk string not followed by CRLF.
    #[error("Protocol error: bulk string of {len} bytes not followed by CRLF")]
    MissingCrlf {
        /// The bulk's length.
        len: usize,
    },
    /// A simple string, error or line with a bare CR or LF inside.
    #[error("Protocol error: unbalanced quotes or bare CR/LF in an inline command")]
    BadInline,
}

fn escape(b: u8) -> String {
    std::ascii::escape_default(b).to_string()
}

/// Finds the CRLF-terminated line starting at `from`: the line's end (the CR's offset).
/// `None` when the line is not complete yet.
fn line_end(buf: &[u8], from: usize) -> Option<usize> {
    let rest = buf.get(from..)?;
    let lf = memchr::memchr(b'\n', rest)?;
    // A line must end in CRLF; a bare LF (or a CR elsewhere) is left to the caller to judge.
    Some(from + lf.saturating_sub(usize::from(lf > 0 && rest[lf - 1] == b'\r')))
}

/// Parses the decimal number in `buf[from..end]`, optionally negative.
fn parse_int(
    buf: &[u8],
    from: usize,
    end: usize,
    what: &'static str,
) -> Result<i64, ProtocolError> {
    let bad = ProtocolError::BadNumber { what, at: from };
    let digits = buf.get(from..end).ok_or(bad.clone())?;
    let (neg, digits) = match digits.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, digits),
    };
    if digits.is_empty() || digits.len() > 19 {
        return Err(bad);
    }
    let mut v: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return Err(bad);
        }
        v = v
            .checked_mul(10)
            .and_then(|v| v.checked_add(i64::from(d - b'0')))
            .ok_or(bad.clone())?;
    }
    Ok(if neg { -v } else { v })
}

/// Checks that the line ending at `end` (a CR's offset) really ends in CRLF.
fn expect_crlf(buf: &[u8], end: usize, at: usize) -> Result<(), ProtocolError> {
    match buf.get(end) {
        Some(b'\r') => Ok(()),
        Some(&found) => Err(ProtocolError::Unexpected {
            expected: "\\r",
            found,
            at,
        }),
        None => Ok(()),
    }
}

/// Cuts one command out of the front of `buf`: either a multibulk (`*N` then N bulk strings,
/// what every client sends) or an inline command (a line of words, what a person types).
/// On success the command's arguments are `args` (ranges of `buf`) and the returned value is
/// how many bytes it took; `Ok(None)` means the command is not complete yet (read more). An
/// empty inline line is a command with no arguments, which the caller skips.
pub fn parse_command(
    buf: &[u8],
    limits: &Limits,
    args: &mut Vec<Range<usize>>,
) -> Result<Option<usize>, ProtocolError> {
    args.clear();
    match buf.first() {
        None => Ok(None),
        Some(b'*') => parse_multibulk(buf, limits, args),
        Some(_) => parse_inline(buf, limits, args),
    }
}

fn parse_multibulk(
    buf: &[u8],
    limits: &Limits,
    args: &mut Vec<Range<usize>>,
) -> Result<Option<usize>, ProtocolError> {
    let Some(end) = line_end(buf, 1) else {
        return too_long_line(buf, limits);
    };
    expect_crlf(buf, end, end)?;
    let n = parse_int(buf, 1, end, "multibulk length")?;
    let mut at = end + 2;
    if n <= 0 {
        // `*0` and `*-1` are empty commands; Redis skips them.
        return Ok(Some(at));
    }
    if n as u64 > limits.max_args as u64 {
        return Err(ProtocolError::TooLarge {
            what: "multibulk length",
            len: n as u64,
            limit: limits.max_args,
        });
    }
    for _ in 0..n {
        match buf.get(at) {
            None => return Ok(None),
            Some(b'$') => {}
            Some(&found) => {
                return Err(ProtocolError::Unexpected {
                    expected: "$",
                    found,
                    at,
                })
            }
        }
        let Some(end) = line_end(buf, at + 1) else {
            return too_long_line(&buf[at..], limits);
        };
        expect_crlf(buf, end, end)?;
        let len = parse_int(buf, at + 1, end, "bulk length")?;
        if len < 0 {
            return Err(ProtocolError::BadNumber {
                what: "bulk length",
                at: at + 1,
            });
        }
        let len = len as u64;
        if len > limits.max_bulk as u64 {
            return Err(ProtocolError::TooLarge {
                what: "bulk length",
                len,
                limit: limits.max_bulk,
            });
        }
        let start = end + 2;
        let stop = start + len as usize;
        if buf.len() < stop + 2 {
            return Ok(None);
        }
        if &buf[stop..stop + 2] != b"\r\n" {
            return Err(ProtocolError::MissingCrlf { len: len as usize });
        }
        args.push(start..stop);
        at = stop + 2;
    }
    Ok(Some(at))
}

/// A line with no LF yet: fine while it could still be a header, an error once it is longer
/// than any header or inline command may be.
fn too_long_line(buf: &[u8], limits: &Limits) -> Result<Option<usize>, ProtocolError> {
    if buf.len() > limits.max_inline {
        Err(ProtocolError::TooLarge {
            what: "line",
            len: buf.len() as u64,
            limit: limits.max_inline,
        })
    } else {
        Ok(None)
    }
}

fn parse_inline(
    buf: &[u8],
    limits: &Limits,
    args: &mut Vec<Range<usize>>,
) -> Result<Option<usize>, ProtocolError> {
    let Some(lf) = memchr::memchr(b'\n', buf) else {
        return too_long_line(buf, limits);
    };
    if lf > limits.max_inline {
        return Err(ProtocolError::TooLarge {
            what: "inline command",
            len: lf as u64,
            limit: limits.max_inline,
        });
    }
    let line_stop = if lf > 0 && buf[lf - 1] == b'\r' {
        lf - 1
    } else {
        lf
    };
    let mut i = 0;
    while i < line_stop {
        let c = buf[i];
        if c == b' ' || c == b'\t' {
            i += 1;
            continue;
        }
        if c == b'"' || c == b'\'' || c == b'\r' {
            // Quoted inline arguments (redis-cli's own parser) are not taken: clients send
            // multibulk, and a person types words.
            return Err(ProtocolError::BadInline);
        }
        let start = i;
        while i < line_stop && buf[i] != b' ' && buf[i] != b'\t' {
            if buf[i] == b'\r' {
                return Err(ProtocolError::BadInline);
            }
            i += 1;
        }
        if args.len() == limits.max_args {
            return Err(ProtocolError::TooLarge {
                what: "inline arguments",
                len: args.len() as u64 + 1,
                limit: limits.max_args,
            });
        }
        args.push(start..i);
    }
    Ok(Some(lf + 1))
}

/// Any RESP2 or RESP3 value.
#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    /// `+text`.
    Simple(Bytes),
    /// `-text`.
    Error(Bytes),
    /// `:n`.
    Integer(i64),
    /// `$n` and n bytes.
    Bulk(Bytes),
    /// RESP2's null bulk string, `$-1`.
    NullBulk,
    /// RESP2's null array, `*-1`.
    NullArray,
    /// `*n` and n frames.
    Array(Vec<Frame>),
    /// RESP3's `_`.
    Null,
    /// RESP3's `#t` / `#f`.
    Boolean(bool),
    /// RESP3's `,` double, kept as its text (so that a frame compares equal to itself).
    Double(Bytes),
    /// RESP3's `(` big number, as its digits.
    BigNumber(Bytes),
    /// RESP3's `!n` blob error.
    BlobError(Bytes),
    /// RESP3's `=n` verbatim string: a 3-byte format and the text.
    Verbatim([u8; 3], Bytes),
    /// RESP3's `%n` map.
    Map(Vec<(Frame, Frame)>),
    /// RESP3's `~n` set.
    Set(Vec<Frame>),
    /// RESP3's `>n` push.
    Push(Vec<Frame>),
    /// RESP3's `|n` attribute map, and the frame it annotates.
    Attribute(Vec<(Frame, Frame)>, Box<Frame>),
}

impl Frame {
    /// A bulk string of `b`'s bytes.
    pub fn bulk(b: impl AsRef<[u8]>) -> Frame {
        Frame::Bulk(Bytes::copy_from_slice(b.as_ref()))
    }

    /// The frame as text, when it is a string of some kind (tests and clients).
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Frame::Simple(b)
            | Frame::Error(b)
            | Frame::Bulk(b)
            | Frame::BlobError(b)
            | Frame::Verbatim(_, b) => Some(b),
            _ => None,
        }
    }

    /// Appends the frame's encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        fn line(out: &mut Vec<u8>, marker: u8, text: &[u8]) {
            out.push(marker);
            out.extend_from_slice(text);
            out.extend_from_slice(b"\r\n");
        }
        fn blob(out: &mut Vec<u8>, marker: u8, b: &[u8]) {
            header(out, marker, b.len() as i64);
            out.extend_from_slice(b);
            out.extend_from_slice(b"\r\n");
        }
        match self {
            Frame::Simple(s) => line(out, b'+', s),
            Frame::Error(s) => line(out, b'-', s),
            Frame::Integer(n) => header(out, b':', *n),
            Frame::Bulk(b) => blob(out, b'$', b),
            Frame::NullBulk => out.extend_from_slice(b"$-1\r\n"),
            Frame::NullArray => out.extend_from_slice(b"*-1\r\n"),
            Frame::Null => out.extend_from_slice(b"_\r\n"),
            Frame::Boolean(b) => out.extend_from_slice(if *b { b"#t\r\n" } else { b"#f\r\n" }),
            Frame::Double(d) => line(out, b',', d),
            Frame::BigNumber(d) => line(out, b'(', d),
            Frame::BlobError(b) => blob(out, b'!', b),
            Frame::Verbatim(format, text) => {
                header(out, b'=', text.len() as i64 + 4);
                out.extend_from_slice(format);
                out.push(b':');
                out.extend_from_slice(text);
                out.extend_from_slice(b"\r\n");
            }
            Frame::Array(items) | Frame::Set(items) | Frame::Push(items) => {
                let marker = match self {
                    Frame::Array(_) => b'*',
                    Frame::Set(_) => b'~',
                    _ => b'>',
                };
                header(out, marker, items.len() as i64);
                for f in items {
                    f.encode(out);
                }
            }
            Frame::Map(pairs) => encode_pairs(out, b'%', pairs),
            Frame::Attribute(pairs, inner) => {
                encode_pairs(out, b'|', pairs);
                inner.encode(out);
            }
        }
    }
}

fn encode_pairs(out: &mut Vec<u8>, marker: u8, pairs: &[(Frame, Frame)]) {
    header(out, marker, pairs.len() as i64);
    for (k, v) in pairs {
        k.encode(out);
        v.encode(out);
    }
}

/// Appends `marker`, the decimal `n` and CRLF.
pub fn header(out: &mut Vec<u8>, marker: u8, n: i64) {
    out.push(marker);
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Parses one frame of any type from the front of `buf`: the frame and the bytes it took, or
/// `Ok(None)` when it is not complete yet.
pub fn parse_frame(buf: &[u8], limits: &Limits) -> Result<Option<(Frame, usize)>, ProtocolError> {
    let mut at = 0;
    match frame_at(buf, &mut at, limits, 0)? {
        Some(f) => Ok(Some((f, at))),
        None => Ok(None),
    }
}

/// The line from `*at + 1` to its CRLF; advances `*at` past it.
fn line_at(
    buf: &[u8],
    at: &mut usize,
    limits: &Limits,
) -> Result<Option<(usize, usize)>, ProtocolError> {
    let from = *at + 1;
    let Some(rest) = buf.get(from..) else {
        return Ok(None);
    };
    let Some(lf) = memchr::memchr(b'\n', rest) else {
        return too_long_line(rest, limits).map(|_| None);
    };
    if lf == 0 || rest[lf - 1] != b'\r' {
        return Err(ProtocolError::Unexpected {
            expected: "\\r\\n",
            found: b'\n',
            at: from + lf,
        });
    }
    let end = from + lf - 1;
    if memchr::memchr(b'\r', &buf[from..end]).is_some() {
        return Err(ProtocolError::BadInline);
    }
    *at = end + 2;
    Ok(Some((from, end)))
}

fn count(n: i64, what: &'static str, at: usize, limit: usize) -> Result<usize, ProtocolError> {
    if n < 0 {
        return Err(ProtocolError::BadNumber { what, at });
    }
    if n as u64 > limit as u64 {
        return Err(ProtocolError::TooLarge {
            what,
            len: n as u64,
            limit,
        });
    }
    Ok(n as usize)
}

fn frame_at(
    buf: &[u8],
    at: &mut usize,
    limits: &Limits,
    depth: usize,
) -> Result<Option<Frame>, ProtocolError> {
    if depth > limits.max_depth {
        return Err(ProtocolError::TooDeep {
            limit: limits.max_depth,
        });
    }
    let start = *at;
    let Some(&marker) = buf.get(start) else {
        return Ok(None);
    };
    let Some((from, end)) = line_at(buf, at, limits)? else {
        return Ok(None);
    };
    let text = || Bytes::copy_from_slice(&buf[from..end]);
    let frame = match marker {
        b'+' => Frame::Simple(text()),
        b'-' => Frame::Error(text()),
        b':' => Frame::Integer(parse_int(buf, from, end, "integer")?),
        b',' => Frame::Double(text()),
        b'(' => Frame::BigNumber(text()),
        b'_' if from == end => Frame::Null,
        b'#' => match &buf[from..end] {
            b"t" => Frame::Boolean(true),
            b"f" => Frame::Boolean(false),
            _ => {
                return Err(ProtocolError::Unexpected {
                    expected: "t or f",
                    found: buf.get(from).copied().unwrap_or(b'\r'),
                    at: from,
                })
            }
        },
        b'$' | b'!' | b'=' => {
            let n = parse_int(buf, from, end, "bulk length")?;
            if marker == b'$' && n == -1 {
                return Ok(Some(Frame::NullBulk));
            }
            let len = count(n, "bulk length", from, limits.max_bulk)?;
            let body = *at;
            if buf.len() < body + len + 2 {
                *at = start;
                return Ok(None);
            }
            if &buf[body + len..body + len + 2] != b"\r\n" {
                return Err(ProtocolError::MissingCrlf { len });
            }
            *at = body + len + 2;
            let b = Bytes::copy_from_slice(&buf[body..body + len]);
            match marker {
                b'$' => Frame::Bulk(b),
                b'!' => Frame::BlobError(b),
                _ => {
                    if len < 4 || b[3] != b':' {
                        return Err(ProtocolError::BadNumber {
                            what: "verbatim string",
                            at: body,
                        });
                    }
                    Frame::Verbatim([b[0], b[1], b[2]], b.slice(4..))
                }
            }
        }
        b'*' | b'~' | b'>' | b'%' | b'|' => {
            let n = parse_int(buf, from, end, "aggregate length")?;
            if marker == b'*' && n == -1 {
                return Ok(Some(Frame::NullArray));
            }
            let pairs = matches!(marker, b'%' | b'|');
            let n = count(n, "aggregate length", from, limits.max_args)?;
            let mut items = Vec::with_capacity(n.min(64) * if pairs { 2 } else { 1 });
            for _ in 0..n * if pairs { 2 } else { 1 } {
                match frame_at(buf, at, limits, depth + 1)? {
                    Some(f) => items.push(f),
                    None => {
                        *at = start;
                        return Ok(None);
                    }
                }
            }
            let paired = || {
                let mut it = items.clone().into_iter();
                let mut out = Vec::with_capacity(n);
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    out.push((k, v));
                }
                out
            };
            match marker {
                b'*' => Frame::Array(items),
                b'~' => Frame::Set(items),
                b'>' => Frame::Push(items),
                b'%' => Frame::Map(paired()),
                _ => {
                    let attrs = paired();
                    match frame_at(buf, at, limits, depth + 1)? {
                        Some(inner) => Frame::Attribute(attrs, Box::new(inner)),
                        None => {
                            *at = start;
                            return Ok(None);
                        }
                    }
                }
            }
        }
        found => {
            return Err(ProtocolError::Unexpected {
                expected: "a RESP type marker",
                found,
                at: start,
            })
        }
    };
    Ok(Some(frame))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A command's arguments, copied out, and the bytes it took.
    type Cut = Option<(Vec<Vec<u8>>, usize)>;

    fn args_of(buf: &[u8]) -> Result<Cut, ProtocolError> {
        let mut args = Vec::new();
        Ok(parse_command(buf, &Limits::default(), &mut args)?
            .map(|n| (args.iter().map(|r| buf[r.clone()].to_vec()).collect(), n)))
    }

    #[test]
    fn a_multibulk_command_is_cut_out_and_a_partial_one_waits() {
        let cmd = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\n*1\r\n";
        let (args, n) = args_of(cmd).unwrap().unwrap();
        assert_eq!(
            args,
            vec![b"SET".to_vec(), b"k".to_vec(), b"hello".to_vec()]
        );
        assert_eq!(&cmd[n..], b"*1\r\n");
        for cut in 0..n {
            assert_eq!(args_of(&cmd[..cut]).unwrap(), None, "cut at {cut}");
        }
    }

    #[test]
    fn inline_commands_are_words() {
        let (args, n) = args_of(b"PING  hello\r\nGET").unwrap().unwrap();
        assert_eq!(args, vec![b"PING".to_vec(), b"hello".to_vec()]);
        assert_eq!(n, 13);
        assert_eq!(args_of(b"\r\n").unwrap().unwrap(), (vec![], 2));
        assert_eq!(args_of(b"SET \"a b\" c\r\n"), Err(ProtocolError::BadInline));
    }

    #[test]
    fn hostile_lengths_are_refused_before_anything_is_reserved() {
        assert!(matches!(
            args_of(b"*2147483647\r\n"),
            Err(ProtocolError::TooLarge { .. })
        ));
        assert!(matches!(
            args_of(b"*1\r\n$999999999999\r\n"),
            Err(ProtocolError::TooLarge { .. })
        ));
        assert!(matches!(
            args_of(b"*1\r\n$99999999999999999999\r\n"),
            Err(ProtocolError::BadNumber { .. })
        ));
        assert!(matches!(
            args_of(b"*1\r\n$-5\r\n"),
            Err(ProtocolError::BadNumber { .. })
        ));
        assert!(matches!(
            args_of(b"*1\r\n:5\r\n"),
            Err(ProtocolError::Unexpected { .. })
        ));
        assert!(matches!(
            args_of(b"*1\r\n$1\r\nabc\r\n"),
            Err(ProtocolError::MissingCrlf { .. })
        ));
        let long = vec![b'a'; Limits::default().max_inline + 2];
        assert!(matches!(
            args_of(&long),
            Err(ProtocolError::TooLarge { .. })
        ));
        let deep = "*1\r\n".repeat(40);
        assert!(matches!(
            parse_frame(deep.as_bytes(), &Limits::default()),
            Err(ProtocolError::TooDeep { .. })
        ));
    }

    fn leaf() -> impl Strategy<Value = Frame> {
        let text = proptest::collection::vec(
            any::<u8>().prop_filter("no CR/LF", |b| *b != b'\r' && *b != b'\n'),
            0..16,
        )
        .prop_map(Bytes::from);
        let blob = proptest::collection::vec(any::<u8>(), 0..64).prop_map(Bytes::from);
        prop_oneof![
            text.clone().prop_map(Frame::Simple),
            text.clone().prop_map(Frame::Error),
            any::<i64>()
                .prop_filter("i64::MIN has 19 digits and a sign", |n| *n != i64::MIN)
                .prop_map(Frame::Integer),
            blob.clone().prop_map(Frame::Bulk),
            Just(Frame::NullBulk),
            Just(Frame::NullArray),
            Just(Frame::Null),
            any::<bool>().prop_map(Frame::Boolean),
            text.clone().prop_map(Frame::Double),
            text.prop_map(Frame::BigNumber),
            blob.clone().prop_map(Frame::BlobError),
            blob.prop_map(|b| Frame::Verbatim(*b"txt", b)),
        ]
    }

    fn frame() -> impl Strategy<Value = Frame> {
        leaf().prop_recursive(4, 64, 8, |inner| {
            let pairs = proptest::collection::vec((inner.clone(), inner.clone()), 0..4);
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Frame::Array),
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Frame::Set),
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Frame::Push),
                pairs.clone().prop_map(Frame::Map),
                (pairs, inner).prop_map(|(p, f)| Frame::Attribute(p, Box::new(f))),
            ]
        })
    }

    proptest! {
        #[test]
        fn every_frame_parses_back_to_itself_and_waits_when_cut(f in frame()) {
            let mut out = Vec::new();
            f.encode(&mut out);
            let (g, n) = parse_frame(&out, &Limits::default()).unwrap().unwrap();
            prop_assert_eq!(&g, &f);
            prop_assert_eq!(n, out.len());
            for cut in [0, out.len() / 2, out.len() - 1] {
                prop_assert_eq!(parse_frame(&out[..cut], &Limits::default()).unwrap(), None);
            }
        }

        #[test]
        fn every_command_parses_back_to_its_arguments(
            args in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 1..8),
        ) {
            let frame = Frame::Array(args.iter().map(Frame::bulk).collect());
            let mut out = Vec::new();
            frame.encode(&mut out);
            let (got, n) = args_of(&out).unwrap().unwrap();
            prop_assert_eq!(got, args);
            prop_assert_eq!(n, out.len());
        }

        #[test]
        fn any_bytes_give_a_command_an_error_or_a_wait_and_never_a_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut args = Vec::new();
            if let Ok(Some(n)) = parse_command(&bytes, &Limits::default(), &mut args) {
                prop_assert!(n <= bytes.len());
                for r in &args {
                    prop_assert!(r.end <= n);
                }
            }
            let _ = parse_frame(&bytes, &Limits::default());
        }
    }
}
