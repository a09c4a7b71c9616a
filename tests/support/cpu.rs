//! CPU time of processes, from /proc (Linux), for the benchmarks' per-event figures.

use std::time::Duration;

/// Clock ticks a second of /proc's times (`getconf CLK_TCK`; 100 on every Linux build
/// herald runs on).
const TICKS: u64 = 100;

/// (parent pid, user + system ticks, children's user + system ticks) of `pid`.
fn stat(pid: u32) -> Option<(u32, u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces and parentheses: fields start after the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let number = |i: usize| fields.get(i)?.parse::<u64>().ok();
    // Fields 4, 14–17 of proc(5), here from field 3 on.
    Some((
        number(1)? as u32,
        number(11)? + number(12)?,
        number(13)? + number(14)?,
    ))
}

/// CPU time `pid` has used so far.
pub fn of(pid: u32) -> Duration {
    stat(pid).map_or(Duration::ZERO, |(_, own, _)| ticks(own))
}

/// CPU time of `pid`, its live children, and the children it has reaped (a server and its
/// backends, PostgreSQL's postmaster for one): across two readings, the difference counts
/// a backend that started or ended between them too.
pub fn of_tree(pid: u32) -> Duration {
    let Some((_, own, reaped)) = stat(pid) else {
        return Duration::ZERO;
    };
    let children: u64 = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(stat)
        .filter(|(parent, _, _)| *parent == pid)
        .map(|(_, own, _)| own)
        .sum();
    ticks(own + reaped + children)
}

fn ticks(n: u64) -> Duration {
    Duration::from_millis(n * 1000 / TICKS)
}
