//! A cursor over AMQP 1.0 encoded values (core spec §1.6), shared by the frame tap
//! ([`super::tap`]: a transfer's performative) and the message scanner ([`super::encoded`]: a
//! message's sections): both read the few fields they use where they lie and skip everything
//! else by the size its constructor gives, without decoding it.

/// Described values nested deeper than this are not skipped (the scanner then leaves the
/// message to fe2o3, the tap leaves the frame alone): the recursion stays bounded whatever
/// the sender nests.
pub const MAX_DEPTH: u32 = 16;

pub struct Reader<'a> {
    pub buf: &'a [u8],
    pub pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn u8(&mut self) -> Option<u8> {
        let b = *self.buf.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    pub fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let out = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(out)
    }

    /// Skips one value of any type and returns its encoding (constructor included). Every
    /// type's size is in its constructor byte: fixed widths by the high nibble, variable and
    /// compound ones after a 1- or 4-byte size.
    pub fn skip(&mut self, depth: u32) -> Option<&'a [u8]> {
        let start = self.pos;
        let code = self.u8()?;
        if code == 0x00 {
            if depth >= MAX_DEPTH {
                return None;
            }
            self.skip(depth + 1)?; // descriptor
            self.skip(depth + 1)?; // value
            return self.buf.get(start..self.pos);
        }
        let len = match code >> 4 {
            0x4 => 0,
            0x5 => 1,
            0x6 => 2,
            0x7 => 4,
            0x8 => 8,
            0x9 => 16,
            0xa | 0xc | 0xe => usize::from(self.u8()?),
            0xb | 0xd | 0xf => self.u32()? as usize,
            _ => return None,
        };
        self.take(len)?;
        self.buf.get(start..self.pos)
    }

    /// Walks a map (or a null, an absent map), calling `entry` with the bytes of each text
    /// key (symbol or string) and the encoding of its value; entries with other keys (ulong)
    /// are skipped.
    pub fn map(&mut self, mut entry: impl FnMut(&'a [u8], &'a [u8])) -> Option<()> {
        let (size, count) = match self.u8()? {
            0x40 => return Some(()),
            0xc1 => {
                let size = usize::from(self.u8()?);
                (size.checked_sub(1)?, usize::from(self.u8()?))
            }
            0xd1 => {
                let size = self.u32()? as usize;
                (size.checked_sub(4)?, self.u32()? as usize)
            }
            _ => return None,
        };
        let mut inner = Reader { buf: self.take(size)?, pos: 0 };
        if count % 2 != 0 {
            return None;
        }
        for _ in 0..count / 2 {
            let key = inner.skip(0)?;
            let value = inner.skip(0)?;
            let name = match key[0] {
                0xa1 | 0xa3 => key.get(2..),
                0xb1 | 0xb3 => key.get(5..),
                _ => None,
            };
            if let Some(name) = name {
                entry(name, value);
            }
        }
        (inner.pos == inner.buf.len()).then_some(())
    }

    /// A uint or null (`Some(None)`); `None`: another type.
    pub fn uint(&mut self) -> Option<Option<u32>> {
        Some(match self.u8()? {
            0x40 => None,
            0x43 => Some(0),
            0x52 => Some(u32::from(self.u8()?)),
            0x70 => Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?)),
            _ => return None,
        })
    }

    /// A boolean; null is false (every boolean of a transfer defaults to false).
    pub fn bool(&mut self) -> Option<bool> {
        match self.u8()? {
            0x40 | 0x42 => Some(false),
            0x41 => Some(true),
            0x56 => Some(self.u8()? != 0),
            _ => None,
        }
    }

}
