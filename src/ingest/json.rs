//! One pass over a JSON body: the members of its top-level object as (key, raw value text),
//! with the whole text validated as strict JSON (RFC 8259) on the way.
//!
//! Nothing is converted and nothing is allocated unless a key holds escapes (it is then
//! unescaped into a `String`) or values nest deeper than [`INLINE_DEPTH`] (the stack of open
//! containers spills to the heap). The scanner is iterative, so no input can exhaust the
//! thread's stack.
//!
//! It accepts exactly what serde_json's `RawValue` reading accepted before it (the property
//! tests compare the two on random and hostile input): UTF-8 text (§8.1) of one value with
//! whitespace around it; in strings no control character, only the escapes of §7, and
//! `\u` followed by four hex digits; in keys a `\u` escape of a UTF-16 surrogate must be half
//! of a pair (a key is decoded to Unicode text); in values it is kept as sent, like any escape
//! (§8.2 leaves such strings to the reader); numbers of §6 of any size; nesting of any depth.

use std::borrow::Cow;

use smallvec::SmallVec;

/// Keys and raw value texts of one JSON object, in order (repeated keys included).
pub type Members<'a> = SmallVec<[(Cow<'a, str>, &'a str); 8]>;

/// Open containers tracked without allocating; deeper nesting spills to the heap.
pub const INLINE_DEPTH: usize = 64;

/// Why a body is not a JSON object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotAnObject {
    /// Not JSON text at all.
    NotJson,
    /// JSON text of another type (array, string, number, literal).
    OtherType,
}

/// The members of a JSON object body, validating the whole body.
pub fn object_members(body: &[u8]) -> Result<Members<'_>, NotAnObject> {
    let mut s = Scanner { b: body, i: 0 };
    s.ws();
    if s.peek() != Some(b'{') {
        return Err(if is_json(body) { NotAnObject::OtherType } else { NotAnObject::NotJson });
    }
    let mut members = Members::new();
    s.object(|key, text| members.push((key, text))).ok_or(NotAnObject::NotJson)?;
    s.ws();
    if s.i != body.len() {
        return Err(NotAnObject::NotJson);
    }
    Ok(members)
}

/// Calls `member` with each (key, value text) of a JSON object body, in order, while
/// validating the whole body: [`object_members`] without collecting them. On an error,
/// `member` may have seen some members of the invalid body.
pub fn for_each_member<'a>(body: &'a [u8], member: impl FnMut(Cow<'a, str>, &'a str)) -> Result<(), NotAnObject> {
    let mut s = Scanner { b: body, i: 0 };
    s.ws();
    if s.peek() != Some(b'{') {
        return Err(if is_json(body) { NotAnObject::OtherType } else { NotAnObject::NotJson });
    }
    s.object(member).ok_or(NotAnObject::NotJson)?;
    s.ws();
    if s.i != body.len() {
        return Err(NotAnObject::NotJson);
    }
    Ok(())
}

/// Whether `body` is JSON text: one value of any type, whitespace around it.
pub fn is_json(body: &[u8]) -> bool {
    let mut s = Scanner { b: body, i: 0 };
    s.ws();
    s.value().is_some() && {
        s.ws();
        s.i == body.len()
    }
}

/// One item of a batch ([`for_each_item`]).
pub enum Item<'i, 'a> {
    /// An object, as its members (in a buffer reused from item to item).
    Object(&'i Members<'a>),
    /// A value of another type, as its text.
    Other(&'a str),
}

/// Why [`for_each_item`] stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum ItemsError<E> {
    /// The body is not JSON text (found at the first item that is not, or after the last).
    NotJson,
    /// What the callback returned.
    Item(E),
}

/// Calls `each` with every element of a JSON array body, in order, or once with the value of
/// any other body, in the same pass that validates it (the keys of an object item are decoded
/// as in [`object_members`], so a lone surrogate escape in one is refused). Stops at the first error: the
/// callback's, or where the text stops being JSON (so what `each` saw may be used only once
/// this returns `Ok`).
pub fn for_each_item<'a, E>(
    body: &'a [u8],
    mut each: impl FnMut(Item<'_, 'a>) -> Result<(), E>,
) -> Result<(), ItemsError<E>> {
    let mut s = Scanner { b: body, i: 0 };
    s.ws();
    let mut members = Members::new();
    let mut one = |s: &mut Scanner<'a>| -> Result<(), ItemsError<E>> {
        if s.peek() == Some(b'{') {
            members.clear();
            s.object(|key, text| members.push((key, text))).ok_or(ItemsError::NotJson)?;
            each(Item::Object(&members)).map_err(ItemsError::Item)
        } else {
            let start = s.i;
            s.value().ok_or(ItemsError::NotJson)?;
            each(Item::Other(s.text(start))).map_err(ItemsError::Item)
        }
    };
    if s.peek() == Some(b'[') {
        s.i += 1;
        s.ws();
        if s.peek() == Some(b']') {
            s.i += 1;
        } else {
            loop {
                one(&mut s)?;
                s.ws();
                match s.next() {
                    Some(b',') => s.ws(),
                    Some(b']') => break,
                    _ => return Err(ItemsError::NotJson),
                }
            }
        }
    } else {
        one(&mut s)?;
    }
    s.ws();
    if s.i != body.len() {
        return Err(ItemsError::NotJson);
    }
    Ok(())
}

/// The text of a JSON string literal (validated, quotes included): borrowed when it holds no
/// escape, decoded otherwise; `None` for a lone surrogate escape (no Unicode text).
pub fn string_text(literal: &str) -> Option<Cow<'_, str>> {
    let inner = literal.strip_prefix('"')?.strip_suffix('"')?;
    if !inner.contains('\\') {
        return Some(Cow::Borrowed(inner));
    }
    unescape(inner.as_bytes()).map(Cow::Owned)
}

/// Byte classes inside a string: 0 plain ASCII, 1 `"`, 2 `\`, 3 control, 4 UTF-8 lead or
/// continuation byte.
static STRING_CLASS: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = match i as u8 {
            b'"' => 1,
            b'\\' => 2,
            0..=0x1F => 3,
            0x80..=0xFF => 4,
            _ => 0,
        };
        i += 1;
    }
    t
};

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    #[inline]
    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    #[inline]
    fn expect(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.i += 1;
        }
    }

    /// An object at its `{`: calls `member` with each (key, value text); stops right after
    /// its `}`.
    fn object(&mut self, mut member: impl FnMut(Cow<'a, str>, &'a str)) -> Option<()> {
        self.i += 1; // '{'
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Some(());
        }
        loop {
            let key = self.key()?;
            self.ws();
            self.expect(b':')?;
            self.ws();
            let start = self.i;
            self.value()?;
            member(key, self.text(start));
            self.ws();
            match self.next()? {
                b',' => self.ws(),
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }

    /// The text from `start` to here (UTF-8: every byte outside strings was ASCII, every
    /// string was checked).
    fn text(&self, start: usize) -> &'a str {
        let bytes = &self.b[start..self.i];
        debug_assert!(std::str::from_utf8(bytes).is_ok());
        // SAFETY: the scanner accepted these bytes: outside strings only ASCII tokens, inside
        // strings only ASCII or complete, valid UTF-8 sequences (`utf8_sequence`).
        unsafe { std::str::from_utf8_unchecked(bytes) }
    }

    /// A key: a string, decoded when it holds escapes (`None` for a lone surrogate escape).
    fn key(&mut self) -> Option<Cow<'a, str>> {
        self.expect(b'"')?;
        let start = self.i;
        let escaped = self.string()?;
        let end = self.i - 1;
        let raw = &self.b[start..end];
        if !escaped {
            // SAFETY: as in `text`: a string the scanner accepted is valid UTF-8.
            return Some(Cow::Borrowed(unsafe { std::str::from_utf8_unchecked(raw) }));
        }
        unescape(raw).map(Cow::Owned)
    }

    /// The rest of a string after its opening quote, up to and including the closing one;
    /// returns whether it held escapes.
    fn string(&mut self) -> Option<bool> {
        let mut escaped = false;
        loop {
            self.skip_plain();
            let c = *self.b.get(self.i)?;
            self.i += 1;
            match STRING_CLASS[c as usize] {
                0 => {} // never after `skip_plain`; plain either way
                1 => return Some(escaped),
                2 => {
                    escaped = true;
                    match self.next()? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                        b'u' => {
                            hex4(self.b.get(self.i..self.i + 4)?)?;
                            self.i += 4;
                        }
                        _ => return None,
                    }
                }
                3 => return None,
                _ => self.i += utf8_sequence(c, &self.b[self.i..])?,
            }
        }
    }

    /// Skips the bytes of a string that need no look (printable ASCII but `"` and `\`):
    /// eight at a time while eight are left ([`special_bytes`]), then one at a time.
    #[inline]
    fn skip_plain(&mut self) {
        let b = self.b;
        let mut i = self.i;
        while let Some(chunk) = b.get(i..i + 8) {
            let special = special_bytes(u64::from_le_bytes(chunk.try_into().expect("eight bytes")));
            if special != 0 {
                self.i = i + (special.trailing_zeros() / 8) as usize;
                return;
            }
            i += 8;
        }
        while let Some(&c) = b.get(i) {
            if STRING_CLASS[c as usize] != 0 {
                break;
            }
            i += 1;
        }
        self.i = i;
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        if self.b.get(self.i..self.i + word.len())? != word {
            return None;
        }
        self.i += word.len();
        Some(())
    }

    /// Skips ASCII digits, eight at a time while eight are left ([`non_digits`]); returns
    /// how many.
    #[inline]
    fn digits(&mut self) -> usize {
        let (b, start) = (self.b, self.i);
        let mut i = start;
        while let Some(chunk) = b.get(i..i + 8) {
            let other = non_digits(u64::from_le_bytes(chunk.try_into().expect("eight bytes")));
            if other != 0 {
                self.i = i + (other.trailing_zeros() / 8) as usize;
                return self.i - start;
            }
            i += 8;
        }
        while let Some(b'0'..=b'9') = b.get(i) {
            i += 1;
        }
        self.i = i;
        i - start
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return None;
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if self.digits() == 0 {
                return None;
            }
        }
        // A digit right after a leading 0 ("01") is not part of any number.
        if let Some(b'0'..=b'9') = self.peek() {
            return None;
        }
        Some(())
    }

    /// One value of any type at the current position (no whitespace before it), nested
    /// containers included; stops right after it.
    #[inline]
    fn value(&mut self) -> Option<()> {
        match self.peek()? {
            b'{' | b'[' => self.nested(),
            c => self.scalar(c),
        }
    }

    /// A value that is not a container, starting with `c`.
    #[inline]
    fn scalar(&mut self, c: u8) -> Option<()> {
        match c {
            b'"' => {
                self.i += 1;
                self.string().map(|_| ())
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    /// A container value and everything in it, without recursion.
    fn nested(&mut self) -> Option<()> {
        // Open containers, innermost last: true for an object.
        let mut open: SmallVec<[bool; INLINE_DEPTH]> = SmallVec::new();
        'value: loop {
            match self.peek()? {
                b'{' => {
                    self.i += 1;
                    self.ws();
                    if self.peek() == Some(b'}') {
                        self.i += 1;
                    } else {
                        self.member_key()?;
                        open.push(true);
                        continue 'value;
                    }
                }
                b'[' => {
                    self.i += 1;
                    self.ws();
                    if self.peek() == Some(b']') {
                        self.i += 1;
                    } else {
                        open.push(false);
                        continue 'value;
                    }
                }
                c => self.scalar(c)?,
            }
            // A value ended: continue or close the containers it ends.
            loop {
                let Some(&object) = open.last() else { return Some(()) };
                self.ws();
                match self.next()? {
                    b',' => {
                        self.ws();
                        if object {
                            self.member_key()?;
                        }
                        continue 'value;
                    }
                    b'}' if object => {
                        open.pop();
                    }
                    b']' if !object => {
                        open.pop();
                    }
                    _ => return None,
                }
            }
        }
    }

    /// `"key" :` inside a nested object, up to the member's value.
    fn member_key(&mut self) -> Option<()> {
        self.expect(b'"')?;
        self.string()?;
        self.ws();
        self.expect(b':')?;
        self.ws();
        Some(())
    }
}

/// A mask with the high bit set in (at least) the first byte of `v`, read little-endian, that
/// a string cannot take as it is: `"`, `\`, a control character, or a non-ASCII byte. Bytes
/// after the first such byte may be flagged wrongly (borrows), so only the lowest set bit
/// counts.
#[inline]
fn special_bytes(v: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero_byte = |x: u64| x.wrapping_sub(ONES) & !x & HIGH;
    let quote = zero_byte(v ^ (ONES * b'"' as u64));
    let backslash = zero_byte(v ^ (ONES * b'\\' as u64));
    let control = v.wrapping_sub(ONES * 0x20) & !v & HIGH;
    quote | backslash | control | (v & HIGH)
}

/// A mask with the high bit set in (at least) the first byte of `v`, read little-endian, that
/// is not an ASCII digit (below `0` or above `9`); as in [`special_bytes`], only the lowest
/// set bit counts.
#[inline]
fn non_digits(v: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let below = v.wrapping_sub(ONES * b'0' as u64) & !v & HIGH;
    let above = (v.wrapping_add(ONES * (127 - b'9') as u64) | v) & HIGH;
    below | above
}

/// The value of four hex digits.
#[inline]
fn hex4(h: &[u8]) -> Option<u16> {
    let mut n = 0u16;
    for &c in h {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            b'A'..=b'F' => c - b'A' + 10,
            _ => return None,
        };
        n = (n << 4) | d as u16;
    }
    Some(n)
}

/// Length of the rest of the UTF-8 sequence that `lead` starts (the bytes after it, in
/// `rest`), `None` unless it is complete and valid (no overlong form, no surrogate, nothing
/// beyond U+10FFFF: the rules of `std::str::from_utf8`).
#[inline]
fn utf8_sequence(lead: u8, rest: &[u8]) -> Option<usize> {
    let cont = |i: usize, lo: u8, hi: u8| rest.get(i).is_some_and(|&c| (lo..=hi).contains(&c));
    let ok = match lead {
        0xC2..=0xDF => cont(0, 0x80, 0xBF),
        0xE0 => cont(0, 0xA0, 0xBF) && cont(1, 0x80, 0xBF),
        0xE1..=0xEC | 0xEE..=0xEF => cont(0, 0x80, 0xBF) && cont(1, 0x80, 0xBF),
        0xED => cont(0, 0x80, 0x9F) && cont(1, 0x80, 0xBF),
        0xF0 => cont(0, 0x90, 0xBF) && cont(1, 0x80, 0xBF) && cont(2, 0x80, 0xBF),
        0xF1..=0xF3 => cont(0, 0x80, 0xBF) && cont(1, 0x80, 0xBF) && cont(2, 0x80, 0xBF),
        0xF4 => cont(0, 0x80, 0x8F) && cont(1, 0x80, 0xBF) && cont(2, 0x80, 0xBF),
        _ => false,
    };
    let rest_len = match lead {
        0xC2..=0xDF => 1,
        0xE0..=0xEF => 2,
        _ => 3,
    };
    ok.then_some(rest_len)
}

/// The text of a string's contents (between its quotes, already validated) with its escapes
/// decoded; `None` when a `\u` escape is a UTF-16 surrogate that is not half of a pair.
fn unescape(raw: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let plain = raw[i..].iter().position(|&c| c == b'\\').unwrap_or(raw.len() - i);
        // SAFETY: the scanner validated the string: its bytes between escapes are UTF-8, and
        // an escape starts at an ASCII byte, so a run before one ends on a char boundary.
        out.push_str(unsafe { std::str::from_utf8_unchecked(&raw[i..i + plain]) });
        i += plain;
        if i == raw.len() {
            break;
        }
        let c = raw[i + 1];
        i += 2;
        out.push(match c {
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let n = hex4(&raw[i..i + 4])?;
                i += 4;
                match n {
                    0xD800..=0xDBFF => {
                        // A leading surrogate: a trailing one must follow, as `\uXXXX`.
                        if raw.get(i..i + 2) != Some(b"\\u") {
                            return None;
                        }
                        let low = hex4(&raw[i + 2..i + 6])?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return None;
                        }
                        i += 6;
                        char::from_u32(0x1_0000 + (((n as u32) - 0xD800) << 10) + (low as u32 - 0xDC00))?
                    }
                    0xDC00..=0xDFFF => return None,
                    _ => char::from_u32(n as u32)?,
                }
            }
            other => other as char, // '"', '\\', '/'
        });
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys_and_values(body: &str) -> Vec<(String, String)> {
        object_members(body.as_bytes()).unwrap().into_iter().map(|(k, v)| (k.into_owned(), v.to_owned())).collect()
    }

    #[test]
    fn members_come_with_their_exact_value_text() {
        assert_eq!(
            keys_and_values(" {\"a\" : [1, {\"b\":null}] ,\"c\\n\\u00e9\\ud83d\\ude80\":\"x\\\"\",\"d\":-0.5e+10 } \n"),
            [("a".into(), "[1, {\"b\":null}]".into()), ("c\né🚀".into(), "\"x\\\"\"".into()), ("d".into(), "-0.5e+10".into())]
        );
        assert_eq!(keys_and_values("{}"), []);
        assert_eq!(keys_and_values("{\"a\":1,\"a\":2}"), [("a".into(), "1".into()), ("a".into(), "2".into())]);
    }

    #[test]
    fn what_is_not_json_is_refused() {
        for bad in [
            "", " ", "{", "}", "{\"a\"}", "{\"a\":}", "{\"a\":1,}", "{,}", "{\"a\":1} x", "{\"a\":01}", "{\"a\":1.}",
            "{\"a\":.5}", "{\"a\":1e}", "{\"a\":-}", "{\"a\":+1}", "{\"a\":tru}", "{\"a\":nul}", "{\"a\":[1,]}",
            "{\"a\":[1 2]}", "{\"a\":{\"b\"}}", "{\"a\":{1:2}}", "{\"a\":\"\t\"}", "{\"a\":\"\\x\"}", "{\"a\":\"\\u12g4\"}",
            "{'a':1}", "{\"a\":NaN}", "{\"a\":[}", "{\"a\":{]}", "{\"\\ud800\":1}", "{\"\\udc00\":1}",
            "{\"\\ud800\\u0041\":1}", "{\"\\ud800x\":1}", "{\"a\":1}\u{0}",
        ] {
            assert_eq!(object_members(bad.as_bytes()).err(), Some(NotAnObject::NotJson), "{bad:?}");
        }
        for bad in [&b"{\"a\":\"\xff\"}"[..], b"{\"a\":\"\xc0\xaf\"}", b"{\"a\":\"\xed\xa0\x80\"}", b"{\"a\":\"\xf4\x90\x80\x80\"}", b"{\"a\xe9\":1}"] {
            assert_eq!(object_members(bad).err(), Some(NotAnObject::NotJson), "{bad:?}");
        }
    }

    #[test]
    fn other_json_types_are_told_apart_from_garbage() {
        for other in ["[1]", " 1 ", "\"s\"", "null", "[{\"\\ud800\":1}]"] {
            assert_eq!(object_members(other.as_bytes()).err(), Some(NotAnObject::OtherType), "{other:?}");
        }
        // A lone surrogate escape is kept as sent in a value, and in a nested key.
        assert_eq!(keys_and_values("{\"a\":\"\\ud800\",\"b\":{\"\\udc00\":1}}").len(), 2);
    }

    #[test]
    fn the_eight_byte_skip_stops_at_the_first_byte_the_table_flags() {
        let mut rng = fastrand::Rng::with_seed(7);
        let interesting = [b'"', b'\\', 0x1F, 0x20, 0x7F, 0x80, 0xFF, b'a', 0x00, 0x21, 0x5B, 0x5D];
        for _ in 0..200_000 {
            let bytes: [u8; 8] = std::array::from_fn(|_| if rng.bool() { interesting[rng.usize(..interesting.len())] } else { rng.u8(..) });
            let first = bytes.iter().position(|&c| STRING_CLASS[c as usize] != 0);
            let mask = special_bytes(u64::from_le_bytes(bytes));
            assert_eq!((mask != 0).then(|| (mask.trailing_zeros() / 8) as usize), first, "{bytes:?}");
        }
    }

    #[test]
    fn the_eight_byte_digit_skip_stops_at_the_first_other_byte() {
        let mut rng = fastrand::Rng::with_seed(8);
        let interesting = [b'0', b'9', b'/', b':', b'.', b'e', 0x00, 0x7F, 0x80, 0xB9, 0xFF, b'-'];
        for _ in 0..200_000 {
            let bytes: [u8; 8] = std::array::from_fn(|_| match rng.u8(..3) {
                0 => interesting[rng.usize(..interesting.len())],
                1 => rng.u8(b'0'..=b'9'),
                _ => rng.u8(..),
            });
            let first = bytes.iter().position(|c| !c.is_ascii_digit());
            let mask = non_digits(u64::from_le_bytes(bytes));
            assert_eq!((mask != 0).then(|| (mask.trailing_zeros() / 8) as usize), first, "{bytes:?}");
        }
    }

    #[test]
    fn nesting_of_any_depth_costs_no_stack() {
        let deep = 1_000_000;
        let body = format!("{{\"a\":{}1{}}}", "[".repeat(deep), "]".repeat(deep));
        assert_eq!(object_members(body.as_bytes()).unwrap().len(), 1);
        let open = format!("{{\"a\":{}", "[{\"k\":".repeat(deep));
        assert_eq!(object_members(open.as_bytes()).err(), Some(NotAnObject::NotJson));
    }
}
