//! Many changes of one session at once through one instance, with several instances' state in
//! Redis (issue 23's seam): a security backend granting a session its devices in parallel must
//! get a 204 for every grant. Each change is versioned in Redis and a lost race reads again;
//! before changes of one session went in turn, N requests at once made the last need N tries,
//! past the 8 allowed, and it answered 503 with no other instance involved.

mod common;

use common::redis::Engine;
use common::{kind, new_agent, Server};

both_engines!(grants_of_one_session_sent_at_once_all_land);

const AT_ONCE: usize = 32;

fn grants_of_one_session_sent_at_once_all_land(redis: Engine) {
    let mut flags = vec!["--cores".to_string(), "2".to_string()];
    flags.extend(redis.flags());
    let server = Server::start(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    let session = server.new_session();
    let go = std::sync::Barrier::new(AT_ONCE);
    let answers: Vec<(u16, String)> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..AT_ONCE)
            .map(|i| {
                let (server, session, go) = (&server, &session, &go);
                scope.spawn(move || {
                    let agent = new_agent();
                    let mut body = kind("d2cMessages", &format!("dev-{i}"));
                    body["sessionId"] = session.as_str().into();
                    go.wait();
                    let (status, text, _) = server.call_on(&agent, "PUT", "/grants", &[common::ADMIN], Some(body));
                    (status, text)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().expect("a grant thread")).collect()
    });
    let refused: Vec<&(u16, String)> = answers.iter().filter(|(status, _)| *status != 204).collect();
    assert!(refused.is_empty(), "{} of {AT_ONCE} grants not taken: {refused:?}", refused.len());
    // Every grant holds: a subscription to each device is permitted.
    for i in 0..AT_ONCE {
        let (status, body) = server.subscribe(&session, kind("d2cMessages", &format!("dev-{i}")));
        assert_eq!(status, 204, "dev-{i}: {body}");
    }
}
