#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| herald_fuzz::manifests(data));
