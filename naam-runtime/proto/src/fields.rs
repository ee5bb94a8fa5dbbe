//! Fixed-layout little-endian fields written into an array on the stack, then appended to a
//! message in one copy.
//!
//! `BytesMut`'s `put_u16_le` and its kind each go through `put_slice`: a capacity check and a
//! call to `memcpy` per field, dozens per exchange on a request's path (a request's and a
//! reply's headers, their descriptors, the seal's header). Fields stored into an array compile
//! to plain stores, and the codecs append the array with one copy
//! ([`Fields::put_into`]: a constant-size move for a layout that fills its array).

use bytes::{BufMut, BytesMut};

/// Up to `N` bytes of fields, in the order written.
pub(crate) struct Fields<const N: usize> {
    buf: [u8; N],
    len: usize,
}

impl<const N: usize> Fields<N> {
    /// No field yet.
    #[inline]
    pub(crate) fn new() -> Self {
        Fields {
            buf: [0; N],
            len: 0,
        }
    }

    /// Appends `bytes`. Panics past `N` bytes: every caller's layout is a constant that fits
    /// (a bug, never input).
    #[inline]
    fn put<const K: usize>(&mut self, bytes: [u8; K]) -> &mut Self {
        self.buf[self.len..self.len + K].copy_from_slice(&bytes);
        self.len += K;
        self
    }

    /// Appends one byte.
    #[inline]
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.put([v])
    }

    /// Appends a little-endian `u16`.
    #[inline]
    pub(crate) fn u16(&mut self, v: u16) -> &mut Self {
        self.put(v.to_le_bytes())
    }

    /// Appends a little-endian `u32`.
    #[inline]
    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.put(v.to_le_bytes())
    }

    /// Appends a little-endian `u64`.
    #[inline]
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.put(v.to_le_bytes())
    }

    /// The bytes written so far.
    #[inline]
    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// Appends the bytes written so far to `out`. A layout that fills its array (every
    /// header) is copied as a move of constant size, a few instructions: `put_slice` of a
    /// length the compiler does not see calls libc's `memcpy`, which for these sizes costs
    /// more than the copy (three calls per operation through the endpoints).
    #[inline]
    pub(crate) fn put_into(&self, out: &mut BytesMut) {
        if self.len != N {
            out.put_slice(self.as_slice());
            return;
        }
        out.reserve(N);
        let spare = &mut out.spare_capacity_mut()[..N];
        for (d, s) in spare.iter_mut().zip(self.buf) {
            d.write(s);
        }
        // SAFETY: the `N` bytes past the buffer's length, within its capacity (reserved
        // above), were all written just above.
        unsafe { out.set_len(out.len() + N) };
    }
}

#[cfg(test)]
mod tests {
    use bytes::{BufMut, BytesMut};

    use super::Fields;

    #[test]
    fn fields_are_laid_out_as_bytes_mut_puts_them() {
        let mut f = Fields::<15>::new();
        f.u8(0xab)
            .u16(0x1234)
            .u32(0xdead_beef)
            .u64(0x0102_0304_0506_0708);
        let mut b = BytesMut::new();
        b.put_u8(0xab);
        b.put_u16_le(0x1234);
        b.put_u32_le(0xdead_beef);
        b.put_u64_le(0x0102_0304_0506_0708);
        assert_eq!(f.as_slice(), &b[..]);
    }

    #[test]
    fn put_into_appends_what_was_written_full_or_not() {
        let mut full = Fields::<12>::new();
        full.u32(7).u64(u64::MAX);
        let mut part = Fields::<12>::new();
        part.u16(0x0102);
        let mut b = BytesMut::from(&b"ab"[..]);
        full.put_into(&mut b);
        part.put_into(&mut b);
        full.put_into(&mut b);
        let mut want = b"ab".to_vec();
        want.extend_from_slice(full.as_slice());
        want.extend_from_slice(&[2, 1]);
        want.extend_from_slice(full.as_slice());
        assert_eq!(&b[..], &want[..]);
    }

    #[test]
    #[should_panic]
    fn a_layout_past_its_array_is_a_bug_caught_at_once() {
        Fields::<3>::new().u32(1);
    }
}
