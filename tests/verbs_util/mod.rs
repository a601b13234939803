//! Shared by the verbs test binaries: which RDMA devices to use, or why to skip.
#![allow(dead_code)]

/// `(target device, initiator device)` (Soft-RoCE: rxe0, rxe1) or the reason to skip.
pub fn devices() -> Result<(String, String), String> {
    if let Ok(devs) = std::env::var("SOFTROCE_DEVS") {
        let d: Vec<&str> = devs.split_whitespace().collect();
        if d.len() >= 2 {
            return Ok((d[0].to_string(), d[1].to_string()));
        }
    }
    match kvwire::verbs::device_names() {
        Err(e) => Err(e.to_string()),
        Ok(names) if names.is_empty() => Err("libibverbs lists no device and SOFTROCE_DEVS is unset".into()),
        Ok(names) => Ok((names[0].clone(), names[0].clone())),
    }
}

#[macro_export]
macro_rules! need_devices {
    () => {
        match $crate::verbs_util::devices() {
            Ok(d) => d,
            Err(why) => {
                eprintln!("skipped: no RDMA device ({why})");
                return;
            }
        }
    };
}
