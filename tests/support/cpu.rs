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

/// The whole machine's CPU from /proc/stat: (busy, all) ticks summed over its cores, busy
/// being everything but idle and waiting for I/O.
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0);
    };
    // user nice system idle iowait irq softirq steal (guest time is counted in user).
    let n: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|f| f.parse().ok())
        .collect();
    let all: u64 = n.iter().sum();
    let idle = n.get(3).copied().unwrap_or(0) + n.get(4).copied().unwrap_or(0);
    (all - idle, all)
}

/// How busy the machine's cores are from a mark on: to tell a rate the cores bound (all
/// busy) from one that waits on something else.
pub struct Machine {
    busy: u64,
    all: u64,
}

impl Machine {
    pub fn mark() -> Self {
        let (busy, all) = machine_ticks();
        Self { busy, all }
    }

    /// Cores busy on average since the mark (of [`std::thread::available_parallelism`]).
    pub fn busy_cores(&self) -> f64 {
        let (busy, all) = machine_ticks();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let all = all.saturating_sub(self.all);
        if all == 0 {
            return 0.0;
        }
        busy.saturating_sub(self.busy) as f64 / all as f64 * cores
    }
}
