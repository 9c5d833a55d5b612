//! `GET /console` (no auth to load; everything it shows needs the admin key, asked once in the
//! page): the live operator console, one HTML file with plain JS and CSS, embedded at build
//! time. No CDN, no build step, nothing fetched but hubcast's own public API (REST, its own
//! session and a socket on /ws), so it works offline and shows nothing the API would not.

use crate::http::Response;

/// The page, as kept in `src/api/console/console.html`.
pub const PAGE: &str = include_str!("console/console.html");

/// Only this origin's scripts, styles, images and connections (the page inlines its own).
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   connect-src 'self' ws: wss:; img-src 'self' data:; base-uri 'none'; form-action 'none'";

pub fn get() -> Response {
    Response::new(200, "text/html; charset=utf-8", PAGE)
        .with_header("content-security-policy", CSP)
        .with_header("cache-control", "no-cache")
}
