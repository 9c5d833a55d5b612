//! Which core owns a key: [`crate::ids::core_of_device`] and [`crate::ids::core_of_session`],
//! named here where the runtime routes by them.

pub use crate::ids::{core_of_device, core_of_session};
