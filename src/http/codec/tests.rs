//! Rules of the codec, plus randomized tests with fixed seeds and bounded iterations (they run
//! in every `cargo test`): arbitrary bytes never panic, chunked encode → decode round-trips,
//! and input split at any point decodes to the same result as input given at once.

use super::*;

fn head(input: &str) -> Result<Option<(RequestHead, Framing, usize)>, HeadError> {
    parse_head(input.as_bytes())
}

fn framing_of(fields: &str) -> Result<Framing, HeadError> {
    head(&format!("POST /x HTTP/1.1\r\nhost: a\r\n{fields}\r\n")).map(|h| h.expect("complete head").1)
}

fn malformed(r: Result<Framing, HeadError>) -> bool {
    matches!(r, Err(HeadError::Malformed(_)))
}

#[test]
fn a_request_head_is_parsed_with_its_length() {
    let input = "GET /devices/d%201?x=1 HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nx-a: 2\r\n\r\nNEXT";
    let (h, framing, n) = head(input).unwrap().unwrap();
    assert_eq!((h.method, h.uri.path(), h.uri.query(), h.version), (Method::GET, "/devices/d%201", Some("x=1"), Version::HTTP_11));
    assert_eq!(h.headers.get_all("x-a").iter().count(), 2);
    assert_eq!((framing, &input[n..]), (Framing::None, "NEXT"));
    assert_eq!(head("GET / HTTP/1.1\r\nHost: a\r\n").unwrap().map(|h| h.2), None);
}

#[test]
fn http_1_1_needs_exactly_one_host() {
    assert!(matches!(head("GET / HTTP/1.1\r\n\r\n"), Err(HeadError::Malformed(_))));
    assert!(matches!(head("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"), Err(HeadError::Malformed(_))));
    assert!(matches!(head("GET / HTTP/1.0\r\n\r\n"), Ok(Some(_))));
}

#[test]
fn heads_over_the_limits_are_too_large() {
    let long = format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "a".repeat(MAX_REQUEST_HEAD_BYTES));
    assert_eq!(head(&long).err(), Some(HeadError::TooLarge));
    assert_eq!(head(&long[..MAX_REQUEST_HEAD_BYTES + 1]).err(), Some(HeadError::TooLarge));
    let many: String = (0..=MAX_HEADERS).map(|i| format!("x{i}: 1\r\n")).collect();
    assert_eq!(head(&format!("GET / HTTP/1.1\r\n{many}\r\n")).err(), Some(HeadError::TooLarge));
}

#[test]
fn empty_lines_before_a_request_are_counted() {
    assert_eq!(leading_empty_lines(b"\r\n\n\r\nGET"), 5);
    assert_eq!(leading_empty_lines(b"\r"), 0);
    assert_eq!(leading_empty_lines(b"GET"), 0);
}

#[test]
fn content_length_must_be_digits_and_agree() {
    assert_eq!(framing_of("content-length: 5\r\n"), Ok(Framing::Length(5)));
    assert_eq!(framing_of("content-length: 0\r\n"), Ok(Framing::None));
    assert_eq!(framing_of("content-length: 5\r\ncontent-length: 5\r\n"), Ok(Framing::Length(5)));
    assert_eq!(framing_of("content-length: 5, 5\r\n"), Ok(Framing::Length(5)));
    assert_eq!(framing_of("content-length: 99999999999999999999999\r\n"), Ok(Framing::Length(u64::MAX)));
    for bad in ["+5", "-1", "5 5", "0x10", "5.0", "", "five"] {
        assert!(malformed(framing_of(&format!("content-length: {bad}\r\n"))), "content-length: {bad:?}");
    }
    assert!(malformed(framing_of("content-length: 5\r\ncontent-length: 6\r\n")));
    assert!(malformed(framing_of("content-length: 5, 6\r\n")));
}

#[test]
fn transfer_encoding_must_be_exactly_chunked_last() {
    assert_eq!(framing_of("transfer-encoding: chunked\r\n"), Ok(Framing::Chunked));
    assert_eq!(framing_of("Transfer-Encoding: Chunked\r\n"), Ok(Framing::Chunked));
    assert!(malformed(framing_of("transfer-encoding: chunked\r\ncontent-length: 5\r\n")));
    for bad in ["chunked, identity", "identity", "chunked, chunked", "gzip", "", "chunked;q=1"] {
        assert!(malformed(framing_of(&format!("transfer-encoding: {bad}\r\n"))), "transfer-encoding: {bad:?}");
    }
    assert!(malformed(framing_of("transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n")));
    assert!(matches!(framing_of("transfer-encoding: gzip, chunked\r\n"), Err(HeadError::NotImplemented(_))));
    let http10 = head("POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n");
    assert!(matches!(http10, Err(HeadError::Malformed(_))));
}

/// Feeds `input` to a decoder in pieces of the given sizes (cycled); the body or the error.
fn decode_in_pieces(input: &[u8], pieces: &[usize], limit: u64) -> Result<(Vec<u8>, Vec<u8>), BodyError> {
    let mut decoder = ChunkedDecoder::new(limit);
    let mut src = BytesMut::new();
    let mut body = BytesMut::new();
    let mut rest = input;
    let mut i = 0;
    loop {
        if decoder.decode(&mut src, &mut body)? {
            src.extend_from_slice(rest);
            return Ok((body.to_vec(), src.to_vec()));
        }
        assert!(body.len() as u64 <= limit, "the decoder holds more than its limit");
        if rest.is_empty() {
            return Err(BodyError::Malformed("incomplete"));
        }
        let n = pieces[i % pieces.len()].clamp(1, rest.len());
        src.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
        i += 1;
    }
}

#[test]
fn chunked_bodies_decode_with_extensions_and_trailers() {
    let input = b"5;name=value\r\nhello\r\n6 ; a=\"b c\"\r\n world\r\n0\r\nx-checksum: 1\r\n\r\nNEXT";
    assert_eq!(decode_in_pieces(input, &[usize::MAX], 100), Ok((b"hello world".to_vec(), b"NEXT".to_vec())));
    assert_eq!(decode_in_pieces(b"0\r\n\r\n", &[1], 100), Ok((vec![], vec![])));
}

#[test]
fn broken_chunked_framing_is_refused() {
    for bad in [
        &b"\r\nhello\r\n0\r\n\r\n"[..], // empty chunk-size line
        b"5\nhello\r\n0\r\n\r\n",       // bare LF
        b"5 \r\nhello\r\n0\r\n\r\n",    // space without an extension
        b"+5\r\nhello\r\n0\r\n\r\n",
        b"5\r\nhelloX\r\n0\r\n\r\n",    // data longer than declared
        b"0\r\nnot a field\r\n\r\n",
        b"0x5\r\nhello\r\n0\r\n\r\n",
    ] {
        assert!(matches!(decode_in_pieces(bad, &[usize::MAX], 100), Err(BodyError::Malformed(_))), "{:?}", String::from_utf8_lossy(bad));
    }
}

#[test]
fn extensions_and_trailers_count_toward_the_head_limits() {
    let too_large = |r| matches!(r, Err(BodyError::FramingTooLarge(_)));
    let long_line = format!("5;{}\r\nhello\r\n0\r\n\r\n", "x".repeat(MAX_CHUNK_LINE));
    assert!(too_large(decode_in_pieces(long_line.as_bytes(), &[7], 100)));
    // Many chunks with extensions each within the line limit, adding up past the budget.
    let ext = format!(";e={}", "x".repeat(1000));
    let chunks: String = (0..MAX_FRAMING_BYTES / ext.len() + 1).map(|_| format!("1{ext}\r\na\r\n")).collect();
    let input = format!("{chunks}0\r\n\r\n");
    assert!(too_large(decode_in_pieces(input.as_bytes(), &[usize::MAX], 1 << 20)));
    let fewer: String = (0..MAX_FRAMING_BYTES / ext.len() - 1).map(|_| format!("1{ext}\r\na\r\n")).collect();
    assert!(decode_in_pieces(format!("{fewer}0\r\n\r\n").as_bytes(), &[usize::MAX], 1 << 20).is_ok());
    // A trailer section past the budget, in bytes or in fields.
    let field = format!("x-t: {}\r\n", "v".repeat(1000));
    let trailers = field.repeat(MAX_FRAMING_BYTES / field.len() + 1);
    assert!(too_large(decode_in_pieces(format!("0\r\n{trailers}\r\n").as_bytes(), &[333], 100)));
    let fields = "x: 1\r\n".repeat(MAX_HEADERS + 1);
    assert!(too_large(decode_in_pieces(format!("0\r\n{fields}\r\n").as_bytes(), &[usize::MAX], 100)));
    let within = "x: 1\r\n".repeat(MAX_HEADERS);
    assert!(decode_in_pieces(format!("0\r\n{within}\r\n").as_bytes(), &[5], 100).is_ok());
}

#[test]
fn a_declared_chunk_over_the_limit_is_refused_before_its_data() {
    let mut decoder = ChunkedDecoder::new(1000);
    let mut body = BytesMut::new();
    assert_eq!(decoder.decode(&mut BytesMut::from(&b"7fffffff\r\n"[..]), &mut body), Err(BodyError::TooLarge));
    let mut decoder = ChunkedDecoder::new(1000);
    assert_eq!(decoder.decode(&mut BytesMut::from(&b"ffffffffffffffffffff\r\n"[..]), &mut body), Err(BodyError::TooLarge));
    // The sum of small chunks counts too.
    let input = encode_chunked(&[b'a'; 1001], &[100]);
    assert_eq!(decode_in_pieces(&input, &[usize::MAX], 1000), Err(BodyError::TooLarge));
    assert!(decode_in_pieces(&input, &[usize::MAX], 1001).is_ok());
}

const ITERATIONS: usize = 3_000;

fn random_bytes(rng: &mut fastrand::Rng, max: usize) -> Vec<u8> {
    // Mostly bytes that matter to the grammar, so random input reaches deep states.
    const ALPHABET: &[u8] = b"\r\n\r\n :;,=0123456789abcdefABCDEF\t\"GETPOSTHTTP/1.1chunkedcontent-lengthtransfer-encoding";
    let len = rng.usize(..=max);
    (0..len).map(|_| if rng.u8(..) < 200 { ALPHABET[rng.usize(..ALPHABET.len())] } else { rng.u8(..) }).collect()
}

#[test]
fn arbitrary_bytes_never_panic_the_head_parser_or_the_framer() {
    let mut rng = fastrand::Rng::with_seed(9);
    let valid = b"POST /ingest HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n0\r\nt: 1\r\n\r\n".to_vec();
    for _ in 0..ITERATIONS {
        let mut input = random_bytes(&mut rng, 300);
        if rng.bool() {
            // A valid request with a few bytes changed.
            input = valid.clone();
            for _ in 0..rng.usize(1..4) {
                let at = rng.usize(..input.len());
                input[at] = rng.u8(..);
            }
        }
        let skip = leading_empty_lines(&input);
        let _ = parse_head(&input[skip..]);
        let _ = decode_in_pieces(&input, &[rng.usize(1..40)], rng.u64(0..200));
    }
}

#[test]
fn chunked_encode_then_decode_round_trips_in_any_pieces() {
    let mut rng = fastrand::Rng::with_seed(91);
    for _ in 0..ITERATIONS {
        let body: Vec<u8> = (0..rng.usize(..2000)).map(|_| rng.u8(..)).collect();
        let sizes: Vec<usize> = (0..rng.usize(1..5)).map(|_| rng.usize(1..600)).collect();
        let mut input = encode_chunked(&body, &sizes);
        input.extend_from_slice(b"GET /next");
        let pieces: Vec<usize> = (0..rng.usize(1..5)).map(|_| rng.usize(1..300)).collect();
        let limit = body.len() as u64 + rng.u64(0..3);
        assert_eq!(decode_in_pieces(&input, &pieces, limit), Ok((body.clone(), b"GET /next".to_vec())));
        if !body.is_empty() {
            assert_eq!(decode_in_pieces(&input, &pieces, body.len() as u64 - 1), Err(BodyError::TooLarge));
        }
    }
}

#[test]
fn input_split_at_any_point_decodes_like_input_given_at_once() {
    let mut rng = fastrand::Rng::with_seed(19);
    for _ in 0..ITERATIONS / 3 {
        let input = if rng.bool() {
            random_bytes(&mut rng, 200)
        } else {
            let body: Vec<u8> = (0..rng.usize(..100)).map(|_| rng.u8(..)).collect();
            encode_chunked(&body, &[rng.usize(1..40)])
        };
        let whole = decode_in_pieces(&input, &[usize::MAX], 150);
        for split in 0..=input.len() {
            let pieces = [split.max(1), usize::MAX];
            assert_eq!(decode_in_pieces(&input, &pieces, 150), whole, "split at {split} of {:?}", String::from_utf8_lossy(&input));
        }
        // The head parser: every strict prefix of a complete head is incomplete, and the
        // whole gives the same head wherever the input ends after it.
        let request = format!("GET /d/{} HTTP/1.1\r\nhost: a\r\ncontent-length: {}\r\n\r\n", rng.u32(..), rng.u8(..));
        let (h, f, n) = head(&request).unwrap().unwrap();
        assert_eq!(n, request.len());
        for cut in 0..request.len() {
            assert!(matches!(parse_head(&request.as_bytes()[..cut]), Ok(None)), "cut at {cut}");
        }
        let (h2, f2, _) = head(&format!("{request}POST")).unwrap().unwrap();
        assert_eq!((h.uri, h.headers, f), (h2.uri, h2.headers, f2));
    }
}
