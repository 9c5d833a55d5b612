//! Shared access signature (SAS) tokens, in the two signing conventions Azure uses
//! (reference `iothub-wire.md` §2.4 and §3.1), for the AMQP source and the IoT Hub client:
//!
//! - **Event Hubs** (and IoT Hub's Event Hub-compatible endpoint) sign with the raw bytes of
//!   the `SharedAccessKey` string;
//! - **IoT Hub** signs with the base64-decoded key.
//!
//! Both sign `urlencode(resource) + "\n" + expiry` with HMAC-SHA256 and send
//! `SharedAccessSignature sr=<resource>&sig=<signature>&se=<expiry>&skn=<key name>`.

use base64::Engine as _;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// Everything but RFC 3986's unreserved characters is escaped (as `encodeURIComponent`).
const COMPONENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');

pub fn url_encode(s: &str) -> String {
    utf8_percent_encode(s, COMPONENT).to_string()
}

/// Which key bytes sign the token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyConvention {
    /// The key string's own bytes (Event Hubs).
    Raw,
    /// The base64-decoded key (IoT Hub).
    Base64Decoded,
}

/// A signed token for `resource`, valid until `expiry` (seconds since the epoch).
pub fn token(resource: &str, key_name: &str, key: &str, convention: KeyConvention, expiry: i64) -> Result<String, String> {
    let key_bytes = match convention {
        KeyConvention::Raw => key.as_bytes().to_vec(),
        KeyConvention::Base64Decoded => base64::engine::general_purpose::STANDARD
            .decode(key)
            .map_err(|_| "SharedAccessKey is not base64 (an IoT Hub key is)".to_string())?,
    };
    let sr = url_encode(resource);
    let signature = sign(&key_bytes, &format!("{sr}\n{expiry}"));
    Ok(format!("SharedAccessSignature sr={sr}&sig={}&se={expiry}&skn={}", url_encode(&signature), url_encode(key_name)))
}

/// The bytes of a base64 `SharedAccessKey` (IoT Hub signs with the decoded key): a key that
/// does not decode cannot sign.
pub fn decode_key(key: &str) -> Result<Vec<u8>, String> {
    base64::engine::general_purpose::STANDARD.decode(key.trim()).map_err(|e| format!("SharedAccessKey is not base64 ({e})"))
}

/// base64(HMAC-SHA256(key, text))
pub fn sign(key: &[u8], text: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    base64::engine::general_purpose::STANDARD.encode(ring::hmac::sign(&key, text.as_bytes()).as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_sha256_matches_rfc_4231_case_2() {
        let expected = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        let raw = base64::engine::general_purpose::STANDARD.decode(sign(b"Jefe", "what do ya want for nothing?")).unwrap();
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, expected);
    }

    #[test]
    fn event_hubs_token_signs_with_the_raw_key_string() {
        let t = token("amqps://ns.servicebus.windows.net/hub", "listen", "a2V5", KeyConvention::Raw, 1_700_000_000).unwrap();
        let sig = url_encode(&sign(b"a2V5", "amqps%3A%2F%2Fns.servicebus.windows.net%2Fhub\n1700000000"));
        assert_eq!(
            t,
            format!("SharedAccessSignature sr=amqps%3A%2F%2Fns.servicebus.windows.net%2Fhub&sig={sig}&se=1700000000&skn=listen")
        );
    }

    #[test]
    fn iot_hub_token_signs_with_the_decoded_key() {
        let t = token("h.azure-devices.net/messages/events", "service", "a2V5", KeyConvention::Base64Decoded, 5).unwrap();
        let sig = url_encode(&sign(b"key", "h.azure-devices.net%2Fmessages%2Fevents\n5"));
        assert!(t.contains(&format!("&sig={sig}&")), "{t}");
        assert!(token("r", "n", "not base64!", KeyConvention::Base64Decoded, 5).is_err());
    }
}
