use std::process::ExitCode;

use clap::Parser;

// mimalloc: gives freed memory back to the system (glibc's arenas kept ~435 MB after
// reading 100,000 subscriptions that need ~150 MB), and is fast under many threads.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // Installed as `kubectl-herald`, kubectl runs it as its plugin: `kubectl herald publish
    // ...` is `herald kubectl publish ...`.
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let plugin = args
        .first()
        .and_then(|program| std::path::Path::new(program).file_name())
        .is_some_and(|name| name == "kubectl-herald");
    if plugin {
        args[0] = "herald".into();
        args.insert(1, "kubectl".into());
    }
    herald::commands::execute(herald::cli::Cli::parse_from(args))
}

/// No transparent huge pages for this process. mimalloc asks for them on its arenas
/// (madvise), and a 2 MiB huge page is resident as a whole however little of it is used and
/// is not given back while any of it is: with 10,000 idle subscriptions in cluster mode RSS
/// was 12 MB higher at start and 0.6 KiB higher per subscription (16 of the arena's 46 MB
/// resident were huge pages). Run as a constructor, before the Rust runtime's first
/// allocation reserves mimalloc's first arena, so that no page of it is ever huge.
#[cfg(target_os = "linux")]
extern "C" fn disable_transparent_huge_pages() {
    // SAFETY: prctl(PR_SET_THP_DISABLE) takes plain integers and touches no memory.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

#[cfg(target_os = "linux")]
#[used]
#[unsafe(link_section = ".init_array")]
static DISABLE_TRANSPARENT_HUGE_PAGES: extern "C" fn() = disable_transparent_huge_pages;
