//! `GET /openapi.json` (no auth): the OpenAPI 3.1 document of the REST API.
//!
//! The document is `docs/openapi.json`, kept in the repo (so clients can be generated without
//! running hubcast) and embedded at build time, so what is served is what was tested:
//! `tests/openapi.rs` validates it and runs Schemathesis against a live server with it.

use crate::http::Response;

/// The document, as kept in `docs/openapi.json`.
pub const DOCUMENT: &str = include_str!("../../docs/openapi.json");

pub fn get() -> Response {
    Response::json(200, DOCUMENT)
}
