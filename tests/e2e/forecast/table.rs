//! The histories the forecast must hold on: one table, read by the unit
//! test of `src/history.rs` (which includes this file) and by the
//! end-to-end test `forecast::` (which plays every row at once on the
//! fake NVML, one GPU a row). Plain Rust with no dependency, so both
//! crates can compile it.
//!
//! A row is the used memory of one GPU over time (knots, linear between,
//! a repeated time a jump), the memory it can use, and what its forecast
//! must do: for a ramp, the time-to-full read when the growth is 25 %,
//! 50 % and 75 % of the way from its start to full is within 15 % of the
//! truth (the first time the row reaches full); for a step, a sawtooth
//! without a leak or noise, no forecast at all; for a ramp that stops, a
//! forecast while it runs and none from a few seconds after.
#![allow(dead_code, unreachable_pub)]

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
/// The fake GPUs' reserved memory (free = total - reserved - used).
pub const RESERVED: u64 = 512 * MIB;
/// A read is within this share of the truth.
pub const TOLERANCE: f64 = 0.15;
/// The shares of the way at which a ramp's forecast is read.
pub const READS: [f64; 3] = [0.25, 0.50, 0.75];

pub struct Row {
    pub name: String,
    /// The GPU's total memory; full is `total - RESERVED` used.
    pub total: u64,
    /// (seconds from the start, used bytes), in time order.
    pub knots: Vec<(f64, u64)>,
    pub expect: Expect,
    /// How long the row runs (seconds).
    pub seconds: f64,
}

pub enum Expect {
    /// Growth from `start`, up from `from` bytes (the top of what came
    /// before), until full. A forecast must exist `first_within` seconds
    /// after the start, when given.
    Ramp {
        start: f64,
        from: u64,
        first_within: Option<f64>,
    },
    /// No forecast at any time.
    Never,
    /// A ramp from `start` that stops at `stop`: a forecast at some time
    /// between, and none from `stop + within` on.
    Stops { start: f64, stop: f64, within: f64 },
}

impl Row {
    /// Memory that can be used before the GPU is full.
    pub fn capacity(&self) -> u64 {
        self.total - RESERVED
    }

    /// Used bytes at `t` seconds.
    pub fn used(&self, t: f64) -> u64 {
        let k = &self.knots;
        let after = k.partition_point(|p| p.0 <= t);
        if after == 0 {
            return k.first().map_or(0, |p| p.1);
        }
        if after == k.len() {
            return k[after - 1].1;
        }
        let (a, b) = (k[after - 1], k[after]);
        let f = (t - a.0) / (b.0 - a.0);
        (a.1 as f64 + f * (b.1 as f64 - a.1 as f64)).round() as u64
    }

    /// The first time (on a 10 ms grid) at or after `from` when used
    /// reaches `bytes`.
    pub fn first_reaching(&self, bytes: u64, from: f64) -> Option<f64> {
        let mut t = from;
        while t <= self.seconds + 1.0 {
            if self.used(t) >= bytes {
                return Some(t);
            }
            t += 0.01;
        }
        None
    }

    /// When the row is full (the truth forecasts are held to).
    pub fn full_at(&self) -> Option<f64> {
        match self.expect {
            Expect::Ramp { start, .. } => self.first_reaching(self.capacity(), start),
            _ => None,
        }
    }

    /// For a ramp: (share, time, bytes) of each read.
    pub fn reads(&self) -> Vec<(f64, f64, u64)> {
        let Expect::Ramp { start, from, .. } = self.expect else {
            return Vec::new();
        };
        READS
            .iter()
            .filter_map(|&q| {
                let bytes = from + ((self.capacity() - from) as f64 * q) as u64;
                Some((q, self.first_reaching(bytes, start)?, bytes))
            })
            .collect()
    }
}

/// A straight ramp at `rate` bytes/s after `steady` seconds at `base`,
/// ending at full (then held).
fn ramp(name: &str, total: u64, base: u64, steady: f64, rate: u64) -> Row {
    let cap = total - RESERVED;
    let end = steady + (cap - base) as f64 / rate as f64;
    Row {
        name: name.to_string(),
        total,
        knots: vec![(0.0, base), (steady, base), (end, cap)],
        expect: Expect::Ramp {
            start: steady,
            from: base,
            first_within: None,
        },
        seconds: end,
    }
}

/// Deterministic noise in [-amplitude, amplitude] for second `i`.
fn noise(i: u64, amplitude: u64, seed: u64) -> i64 {
    let mut x =
        (i ^ seed.rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    let span = 2 * amplitude + 1;
    (x % span) as i64 - amplitude as i64
}

/// `row`'s knots with noise of `amplitude` added once a second, held for
/// the second (`seed` picks the noise).
fn noisy(mut row: Row, amplitude: u64, seed: u64) -> Row {
    // Past the end, so a ramp's last knot is full.
    row.seconds += 5.0;
    let cap = row.capacity();
    // Held for each second (two knots a second): a second's largest
    // figure does not depend on how many samples fell in it.
    let knots = (0..=row.seconds as u64)
        .flat_map(|i| {
            let clean = row.used(i as f64);
            let v = clean as i64 + noise(i, amplitude, seed);
            let v = if clean >= cap {
                cap
            } else {
                (v.max(0) as u64).min(cap)
            };
            [(i as f64, v), (i as f64 + 0.999, v)]
        })
        .collect();
    row.knots = knots;
    row
}

/// `row` after `seconds` flat at its first value (a job that loads, then
/// starts its loop): a step into what the row does.
fn after_flat(mut row: Row, seconds: f64) -> Row {
    let first = row.knots.first().map_or(0, |k| k.1);
    for k in &mut row.knots {
        k.0 += seconds;
    }
    row.knots.insert(0, (0.0, first));
    row.seconds += seconds;
    row.name = format!("{} after {seconds:.0} s flat", row.name);
    row
}

/// A training loop: `amplitude` allocated for the first half of every
/// `period` seconds and freed for the second, on a base that grows by
/// `leak` bytes/s from the start.
fn sawtooth(
    name: &str,
    total: u64,
    base: u64,
    amplitude: u64,
    period: f64,
    leak: u64,
    seconds: f64,
) -> Row {
    let cap = total - RESERVED;
    let at = |t: f64| (base + (leak as f64 * t) as u64).min(cap);
    let mut knots = Vec::new();
    let mut t = 0.0;
    while t <= seconds {
        let half = t + period / 2.0;
        knots.push((t, at(t)));
        knots.push((t, (at(t) + amplitude).min(cap)));
        knots.push((half, (at(half) + amplitude).min(cap)));
        knots.push((half, at(half)));
        t += period;
    }
    Row {
        name: name.to_string(),
        total,
        knots,
        expect: if leak == 0 {
            Expect::Never
        } else {
            Expect::Ramp {
                start: 0.0,
                from: base + amplitude,
                first_within: None,
            }
        },
        seconds,
    }
}

/// Every row.
pub fn rows() -> Vec<Row> {
    let h200 = 150_754_820_096;
    let h100 = 85_520_809_984;
    let t4 = 16 * GIB;
    let t4_32 = 32 * GIB;
    let mut rows = Vec::new();
    // Ramps from 10 MiB/s to 2 GiB/s after steady periods of 0 to 30
    // minutes, other processes holding memory steady meanwhile. Each rate
    // on a GPU it fills in minutes (a 10 MiB/s ramp on an H200 would take
    // three hours).
    let rates = [
        ("10 MiB/s", t4, 6 * GIB, 10 * MIB),
        ("100 MiB/s", h100, 20 * GIB, 100 * MIB),
        ("1 GiB/s", h200, 40 * GIB, GIB),
        ("2 GiB/s", h200, 40 * GIB, 2 * GIB),
    ];
    for (rate_name, total, base, rate) in rates {
        for steady_min in [0, 2, 10, 30] {
            let name = format!("ramp {rate_name} after {steady_min} min steady");
            rows.push(ramp(&name, total, base, steady_min as f64 * 60.0, rate));
        }
    }
    // The H200 case, filling in two minutes: a forecast within
    // 20 s of the growth starting.
    let mut fast = ramp(
        "fills in 2 min after 5 min steady",
        h200,
        40 * GIB,
        300.0,
        850 * MIB,
    );
    if let Expect::Ramp { first_within, .. } = &mut fast.expect {
        *first_within = Some(20.0);
    }
    rows.push(fast);
    rows.push(noisy(
        ramp(
            "ramp 200 MiB/s with noise (±64 MiB)",
            h100,
            20 * GIB,
            300.0,
            200 * MIB,
        ),
        64 * MIB,
        1,
    ));
    // Other processes free memory while one grows: the GPU's used memory
    // grows at the difference (1 GiB/s - 256 MiB/s).
    rows.push(ramp(
        "one grows 1 GiB/s while others free 256 MiB/s",
        h200,
        90 * GIB,
        240.0,
        768 * MIB,
    ));
    // Another process exits (20 GiB freed) 2 s into a 300 MiB/s ramp.
    {
        let cap = h200 - RESERVED;
        let base = 60 * GIB;
        let rate = 300 * MIB;
        let drop = 20 * GIB;
        let low = base + 2 * rate - drop;
        let end = 242.0 + (cap - low) as f64 / rate as f64;
        rows.push(Row {
            name: "another process exits 2 s into a 300 MiB/s ramp".into(),
            total: h200,
            knots: vec![
                (0.0, base),
                (240.0, base),
                (242.0, base + 2 * rate),
                (242.0, low),
                (end, cap),
            ],
            expect: Expect::Ramp {
                start: 242.0,
                from: low,
                first_within: None,
            },
            seconds: end,
        });
    }
    rows.push(sawtooth(
        "sawtooth (8 GiB every 6 s) with a 40 MiB/s leak",
        h100,
        30 * GIB,
        8 * GIB,
        6.0,
        40 * MIB,
        1_300.0,
    ));
    rows.push(sawtooth(
        "sawtooth (8 GiB every 6 s) without a leak",
        h100,
        30 * GIB,
        8 * GIB,
        6.0,
        0,
        900.0,
    ));
    rows.push(Row {
        name: "a step (a model loads, 60 GiB in 3 s), then flat".into(),
        total: h200,
        knots: vec![(0.0, 10 * GIB), (120.0, 10 * GIB), (123.0, 70 * GIB)],
        expect: Expect::Never,
        seconds: 900.0,
    });
    rows.push(Row {
        name: "two steps (20 GiB, then 30 GiB 100 s later)".into(),
        total: h200,
        knots: vec![
            (0.0, 10 * GIB),
            (120.0, 10 * GIB),
            (121.0, 30 * GIB),
            (220.0, 30 * GIB),
            (221.0, 60 * GIB),
        ],
        expect: Expect::Never,
        seconds: 900.0,
    });
    for seed in 1..=3 {
        rows.push(noisy(
            Row {
                name: format!("flat with noise (±512 MiB, seed {seed})"),
                total: h100,
                knots: vec![(0.0, 40 * GIB)],
                expect: Expect::Never,
                seconds: 900.0,
            },
            512 * MIB,
            seed,
        ));
    }
    rows.push(after_flat(
        sawtooth(
            "sawtooth (8 GiB every 6 s) without a leak",
            h100,
            30 * GIB,
            8 * GIB,
            6.0,
            0,
            780.0,
        ),
        120.0,
    ));
    rows.push(after_flat(
        noisy(
            Row {
                name: "flat with noise (±512 MiB, seed 4)".into(),
                total: h100,
                knots: vec![(0.0, 40 * GIB)],
                expect: Expect::Never,
                seconds: 780.0,
            },
            512 * MIB,
            4,
        ),
        120.0,
    ));
    rows.push(sawtooth(
        "sawtooth (16 GiB every 20 s) without a leak",
        h200,
        40 * GIB,
        16 * GIB,
        20.0,
        0,
        900.0,
    ));
    rows.push(sawtooth(
        "sawtooth (2 GiB every 2 s) with a 10 MiB/s leak",
        t4_32,
        8 * GIB,
        2 * GIB,
        2.0,
        10 * MIB,
        2_400.0,
    ));
    {
        let base = 30 * GIB;
        let rate = 500 * MIB;
        rows.push(Row {
            name: "a ramp that stops (500 MiB/s for 60 s)".into(),
            total: h200,
            knots: vec![(0.0, base), (120.0, base), (180.0, base + 60 * rate)],
            expect: Expect::Stops {
                start: 120.0,
                stop: 180.0,
                within: 5.0,
            },
            seconds: 600.0,
        });
    }
    rows
}
