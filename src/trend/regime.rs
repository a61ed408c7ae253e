//! The present regime of a series of memory figures (one point a second)
//! and whether it grows: where the GPU's (or a PyTorch process's) memory
//! started doing what it does now, and at what rate, so a time-to-full
//! comes from the current growth only — not from a window that mixes
//! minutes of steady use before it with the growth (which made the old
//! 10-minute fit late by a factor of 2.5 to 7 on the H200).
//!
//! **Change points by binary segmentation.** Over the points, the best
//! single split into two independent straight lines (least squares, each
//! side at least [`MIN_SEGMENT`] points) is kept when it explains the
//! points better than one line by more than a BIC-like margin
//! (`SPLIT_PENALTY · ln n · σ²`, σ² the residual variance after the
//! split); then the later side is split again, at most [`MAX_SPLITS`]
//! times. A ramp after a steady period splits at its knee, a step splits
//! at the step, a ramp that stops splits where it stopped; a training
//! loop's sawtooth (allocate and free each step) does not split, since
//! its teeth are the residual variance of either side, and what remains
//! is the slow leak underneath, if any.
//!
//! **Growth** is then asked of the last regime: at least [`MIN_SEGMENT`]
//! points over [`MIN_SPAN`] seconds; a line that fits better than a
//! single step (flat, a jump, flat); a slope above 0 by
//! [`MIN_T`] standard errors (noise and teeth are not growth) and, for a
//! regime under a minute, a rise of [`MIN_RISE`] standard deviations of
//! the regime before (a short stretch of noise that happened to line up
//! is not either); rising over
//! each third at a quarter of the rate or more (a step the segmentation
//! has not cut off yet, within [`MIN_SEGMENT`] seconds of it, leaves a
//! flat third); and its last
//! [`TAIL`] points not clearly below the line (a ramp that stopped loses
//! its forecast within a few points, before the segmentation cuts the
//! flat part off).
//!
//! Cost: the fits of every split come from prefix sums, so one search is
//! O(n) per split tried: at 600 points, a few microseconds. The history
//! calls it once per GPU per new second, never per sample
//! (`history.rs`; `cargo bench --bench forecast`). A flat history (every
//! figure the same: an idle GPU's) has a slope of exactly 0 and is
//! answered with one comparison a point, without the sums or the search.
//!
//! Written by hand: the statistics crates on crates.io fit one line or run
//! generic change-point searches (PELT over a cost function) at far more
//! cost and code than these prefix sums; this is 150 lines and tested on
//! the histories the forecast must hold on (the table in `history.rs`).
//! Floats, in MiB and seconds from the first point: the sums of 600
//! points stay below 2^44, far inside f64's 53 bits.

/// Each side of a split, and the regime a forecast is made from, holds at
/// least this many points (seconds).
pub const MIN_SEGMENT: usize = 7;
/// ... over at least this many seconds.
pub const MIN_SPAN: u64 = 7;
/// Splits tried, the latest part each time.
pub const MAX_SPLITS: usize = 5;
/// A split is kept when it lowers the squared error by more than this
/// many times `ln n · σ²`.
pub const SPLIT_PENALTY: f64 = 4.0;
/// The slope must exceed this many standard errors.
pub const MIN_T: f64 = 5.0;
/// The regime must rise by this many standard deviations of the previous
/// regime's residuals (the noise it came out of).
pub const MIN_RISE: f64 = 8.0;
/// ... when it holds fewer points than this: over a longer regime the
/// slope's standard error already tells growth from chance, and a slow
/// leak under a sawtooth (the regime before as noisy as this one) need
/// not rise by eight teeth to be seen.
pub const RISE_CHECKED_BELOW: usize = 60;
/// The last points that must not have fallen clearly below the line.
pub const TAIL: usize = 3;
/// Noise below this (in MiB, one standard deviation) is not told apart
/// from none: 64 KiB, under one allocation segment.
const NOISE_FLOOR_MIB: f64 = 1.0 / 16.0;
const MIB: f64 = 1_048_576.0;

/// The growing regime at the end of a series.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Regime {
    /// Index of its first point in the series.
    pub start: usize,
    /// Growth in y units (bytes) per x unit (second).
    pub slope: f64,
    /// The top of the regime at its last point: the fitted line there
    /// plus the largest residual above the line within the regime (the
    /// peak of a sawtooth's teeth, or of the noise), in y units.
    pub level: f64,
    /// x of the regime's last point.
    pub last_x: u64,
    /// From its first point to its last, in x units.
    pub span: u64,
}

/// One least-squares line over a range of points (relative units).
#[derive(Debug, Clone, Copy)]
struct Fit {
    n: f64,
    mean_x: f64,
    mean_y: f64,
    /// Σ(x - x̄)².
    cxx: f64,
    slope: f64,
    /// Residual sum of squares.
    sse: f64,
}

impl Fit {
    fn at(&self, x: f64) -> f64 {
        self.mean_y + self.slope * (x - self.mean_x)
    }

    /// Residual variance, at least the noise floor.
    fn variance(&self) -> f64 {
        (self.sse / (self.n - 2.0).max(1.0)).max(NOISE_FLOOR_MIB * NOISE_FLOOR_MIB)
    }
}

/// The regime search, with its scratch space kept between calls (one
/// per series owner, so a search allocates nothing once warm).
#[derive(Debug, Default)]
pub struct Finder {
    /// Prefix sums of (1, x, y, x², xy, y²) over the points before i.
    sums: Vec<[f64; 6]>,
    /// The points in relative units.
    xy: Vec<(f64, f64)>,
}

impl Finder {
    /// The growing regime at the end of `points` (x strictly increasing),
    /// or `None` when the series does not grow now.
    pub fn growth(&mut self, points: &[(u64, u64)]) -> Option<Regime> {
        let &(x0, y0) = points.first()?;
        // Every figure the same (an idle GPU's history): the slope is
        // exactly 0, which is never growth; no sums, no search.
        if points.iter().all(|&(_, y)| y == y0) {
            return None;
        }
        let m = points.len();
        self.xy.clear();
        self.sums.clear();
        self.sums.push([0.0; 6]);
        let mut acc = [0.0f64; 6];
        for &(x, y) in points {
            let x = (x - x0) as f64;
            let y = (i128::from(y) - i128::from(y0)) as f64 / MIB;
            self.xy.push((x, y));
            for (a, v) in acc.iter_mut().zip([1.0, x, y, x * x, x * y, y * y]) {
                *a += v;
            }
            self.sums.push(acc);
        }
        let (before, start) = self.segment(m);
        self.grows(before, start, m).map(|(slope, level)| Regime {
            start,
            slope: slope * MIB,
            level: y0 as f64 + level * MIB,
            last_x: points[m - 1].0,
            span: points[m - 1].0 - points[start].0,
        })
    }

    /// The line through points `i..j`.
    fn fit(&self, i: usize, j: usize) -> Fit {
        let (a, b) = (&self.sums[i], &self.sums[j]);
        let d = |k: usize| b[k] - a[k];
        let (n, sx, sy, sxx, sxy, syy) = (d(0), d(1), d(2), d(3), d(4), d(5));
        let cxx = sxx - sx * sx / n;
        let cxy = sxy - sx * sy / n;
        let cyy = syy - sy * sy / n;
        let slope = if cxx > 0.0 { cxy / cxx } else { 0.0 };
        let sse = if cxx > 0.0 {
            cyy - cxy * cxy / cxx
        } else {
            cyy
        };
        Fit {
            n,
            mean_x: sx / n,
            mean_y: sy / n,
            cxx,
            slope,
            sse: sse.max(0.0),
        }
    }

    /// Where the last regime of points `..m` starts (binary segmentation
    /// of the latest part, then merged back over the parts before that
    /// continue it), and where the one before it started.
    fn segment(&self, m: usize) -> (usize, usize) {
        let mut cuts = vec![0];
        let mut start = 0;
        for _ in 0..MAX_SPLITS {
            let n = m - start;
            if n < 2 * MIN_SEGMENT {
                break;
            }
            let whole = self.fit(start, m).sse;
            let (mut best, mut at) = (f64::INFINITY, start);
            for k in start + MIN_SEGMENT..=m - MIN_SEGMENT {
                let cost = self.fit(start, k).sse + self.fit(k, m).sse;
                if cost < best {
                    (best, at) = (cost, k);
                }
            }
            let variance = (best / (n as f64 - 4.0)).max(NOISE_FLOOR_MIB * NOISE_FLOOR_MIB);
            if whole - best > SPLIT_PENALTY * (n as f64).ln() * variance {
                start = at;
                cuts.push(at);
            } else {
                break;
            }
        }
        // A cut where nothing changed: one odd point (a sample read late,
        // a tooth's edge) makes two lines fit better than one, though the
        // growth on either side is the same. Merged back while the part
        // before has the regime's slope and meets its line at the cut.
        cuts.pop();
        while let Some(&before) = cuts.last() {
            if !self.continues(before, start, m) {
                return (before, start);
            }
            start = before;
            cuts.pop();
        }
        (0, start)
    }

    /// Points `a..b` go on as `b..m` do: the same slope (within a fifth,
    /// three standard errors, or the tilt a sawtooth gives a line) and the lines meeting at `b`, within
    /// three standard errors of the two lines' levels there, plus two
    /// seconds of the growth (a sample read late), plus the smaller of
    /// the two sides' residual deviations (a sawtooth's line tilts with
    /// the phase its ends cut the teeth at). A step out of a flat stretch
    /// does not meet; one inside a sawtooth must exceed its teeth.
    fn continues(&self, a: usize, b: usize, m: usize) -> bool {
        let (p, r) = (self.fit(a, b), self.fit(b, m));
        let se = |f: &Fit| f.variance() / f.cxx;
        // A sawtooth tilts a line by up to about its deviation over the
        // span, with the phase the ends cut the teeth at.
        let span = |i: usize, j: usize| (self.xy[j - 1].0 - self.xy[i].0).max(1.0);
        let tilt = 2.0 * (p.variance().sqrt() / span(a, b) + r.variance().sqrt() / span(b, m));
        let slopes = (p.slope - r.slope).abs()
            <= 0.2 * p.slope.abs().max(r.slope.abs()) + 3.0 * (se(&p) + se(&r)).sqrt() + tilt;
        let x = self.xy[b].0;
        let level_se2 = |f: &Fit| f.variance() * (1.0 / f.n + (x - f.mean_x).powi(2) / f.cxx);
        let meet = (p.at(x) - r.at(x)).abs()
            <= 3.0 * (level_se2(&p) + level_se2(&r)).sqrt()
                + 2.0 * r.slope.abs()
                + p.variance().min(r.variance()).sqrt();
        slopes && meet
    }

    /// The squared error of the best single step over points `i..j`: a
    /// constant on each side of one jump.
    fn step_sse(&self, i: usize, j: usize) -> f64 {
        let flat = |a: usize, b: usize| {
            let (p, q) = (&self.sums[a], &self.sums[b]);
            let (n, sy, syy) = (q[0] - p[0], q[2] - p[2], q[5] - p[5]);
            (syy - sy * sy / n).max(0.0)
        };
        (i + 1..j)
            .map(|k| flat(i, k) + flat(k, j))
            .fold(f64::INFINITY, f64::min)
    }

    /// The slope and the level at the last point (relative units) of
    /// points `start..m` when they grow (the module doc's conditions);
    /// `before..start` is the regime before.
    fn grows(&self, before: usize, start: usize, m: usize) -> Option<(f64, f64)> {
        let n = m - start;
        let (first, last) = (self.xy[start].0, self.xy[m - 1].0);
        if n < MIN_SEGMENT || last - first < MIN_SPAN as f64 {
            return None;
        }
        let f = self.fit(start, m);
        // The noise: the regime's own residuals, or the regime before's
        // where larger (a short stretch of noise that lined up by chance
        // has smaller residuals than the noise around it).
        let noise = if start - before >= MIN_SEGMENT {
            self.fit(before, start).variance().max(f.variance())
        } else {
            f.variance()
        };
        let sigma2 = f.variance().max(noise);
        let se = (sigma2 / f.cxx).sqrt();
        if !(f.slope > 0.0 && f.slope > MIN_T * se) {
            return None;
        }
        // A step explains it at least as well: flat, a jump, flat (a
        // model load, a sawtooth that began after a flat stretch, whose
        // teeth hid the jump from the cut) is not growth.
        if self.step_sse(start, m) <= f.sse {
            return None;
        }
        // A fluke of noise that happens to line up over a short regime
        // rises by a few standard deviations; growth keeps rising.
        if n < RISE_CHECKED_BELOW && f.slope * (last - first) < MIN_RISE * noise.sqrt() {
            return None;
        }
        // Each third rises too, at a quarter of the regime's rate or more
        // (within two of its own standard errors): a step inside a short
        // regime leaves a flat third.
        let third = (last - first) / 3.0;
        let mut from = start;
        for k in 1..=3 {
            let to = if k == 3 {
                m
            } else {
                start + self.xy[start..m].partition_point(|p| p.0 <= first + third * k as f64)
            };
            if to - from < 2 {
                return None;
            }
            let part = self.fit(from, to);
            let se = (part.variance() / part.cxx).sqrt();
            if part.slope < 0.25 * f.slope - 2.0 * se {
                return None;
            }
            from = to;
        }
        let residual = |&(x, y): &(f64, f64)| y - f.at(x);
        let tail = &self.xy[m - TAIL.min(n)..m];
        let tail_mean = tail.iter().map(residual).sum::<f64>() / tail.len() as f64;
        let allowed = (1.5 * f.slope).max(3.0 * (sigma2 / tail.len() as f64).sqrt());
        if tail_mean < -allowed {
            return None;
        }
        // The top of the regime: the line plus its largest residual (the
        // tops of a sawtooth's teeth).
        let top = self.xy[start..m]
            .iter()
            .map(residual)
            .fold(0.0f64, f64::max);
        Some((f.slope, f.at(last) + top))
    }
}
