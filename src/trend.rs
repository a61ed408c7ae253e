//! Least-squares slopes: a torch process's allocated bytes over its steps
//! (is it leaking?) and a GPU's used bytes over time (when is it full?).
//!
//! Written by hand rather than taken from a statistics crate: it is two
//! sums over at most a few hundred points, and it is computed in integers
//! (`i128`) so that an exactly linear series gives its exact slope — a
//! loop retaining 3 MiB per step reads 3145728 bytes per step, not
//! 3145727.9999. A slope is kept as a reduced fraction ([`Slope`]) so the
//! model stays `Eq`; it becomes a float only where it is written out.
//!
//! [`regime`] finds where a series' present regime began and whether it
//! grows (the forecasts of `history.rs`).

pub mod regime;

/// The growth figure needs at least this many steps.
pub const MIN_GROWTH_STEPS: usize = 16;
/// ... and is taken over at most this many (the last ones).
pub const MAX_GROWTH_STEPS: usize = 64;

/// A slope as the exact fraction `num / den` (`den > 0`, reduced).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slope {
    num: i128,
    den: i128,
}

impl Slope {
    /// The slope as a float (y units per x unit).
    pub fn value(self) -> f64 {
        self.num as f64 / self.den as f64
    }

    /// Strictly rising.
    pub fn rising(self) -> bool {
        self.num > 0
    }
}

fn gcd(mut a: i128, mut b: i128) -> i128 {
    (a, b) = (a.abs(), b.abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The least-squares slope of `y` over `x` through `points`, or `None`
/// with fewer than two distinct `x` (or sums too large for `i128`, which
/// no real series reaches). Coordinates are taken relative to the first
/// point, so absolute step numbers, Unix times and byte counts do not
/// grow the sums.
pub fn slope(points: &[(u64, u64)]) -> Option<Slope> {
    let &(x0, y0) = points.first()?;
    let n = i128::try_from(points.len()).ok()?;
    let (mut sx, mut sy, mut sxx, mut sxy) = (0i128, 0i128, 0i128, 0i128);
    for &(x, y) in points {
        let x = i128::from(x) - i128::from(x0);
        let y = i128::from(y) - i128::from(y0);
        sx = sx.checked_add(x)?;
        sy = sy.checked_add(y)?;
        sxx = sxx.checked_add(x.checked_mul(x)?)?;
        sxy = sxy.checked_add(x.checked_mul(y)?)?;
    }
    let den = n.checked_mul(sxx)?.checked_sub(sx.checked_mul(sx)?)?;
    let num = n.checked_mul(sxy)?.checked_sub(sx.checked_mul(sy)?)?;
    if den <= 0 {
        return None;
    }
    let g = gcd(num, den).max(1);
    Some(Slope {
        num: num / g,
        den: den / g,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn line(n: u64, start: u64, per: i64) -> Vec<(u64, u64)> {
        (0..n)
            .map(|i| (1000 + i, (start as i64 + per * i as i64) as u64))
            .collect()
    }

    #[test]
    fn slopes() {
        type Points = Vec<(u64, u64)>;
        let cases: Vec<(&str, Points, Option<f64>)> = vec![
            (
                "3 MiB per step",
                line(64, 10 << 30, 3 << 20),
                Some(3.0 * MIB as f64),
            ),
            (
                "4 MiB per step, 16 steps",
                line(16, 1 << 30, 4 << 20),
                Some(4.0 * MIB as f64),
            ),
            ("flat", line(64, 5 << 30, 0), Some(0.0)),
            (
                "shrinking",
                line(20, 5 << 30, -(1 << 20)),
                Some(-(MIB as f64)),
            ),
            ("one point", line(1, 1, 1), None),
            ("no points", vec![], None),
            ("one x twice", vec![(5, 1), (5, 9)], None),
        ];
        for (name, points, want) in cases {
            assert_eq!(slope(&points).map(Slope::value), want, "{name}");
        }
        // A sawtooth (8, 9, 8, 9 MiB ...) is not growth: the fit over 64
        // steps is under 1/64 MiB per step.
        let sawtooth: Vec<(u64, u64)> = (0..64).map(|i| (i, 8 * MIB + (i % 2) * MIB)).collect();
        let g = slope(&sawtooth).map(Slope::value).unwrap_or(f64::NAN);
        assert!(g.abs() <= MIB as f64 / 64.0, "sawtooth: {g}");
    }

    #[test]
    fn exact_whatever_the_offsets() {
        // Unix-time x and H200-sized y: relative coordinates keep it exact.
        let points: Vec<(u64, u64)> = (0..600)
            .map(|i| (1_764_633_600 + i, 100_000_000_000 + 123_457 * i))
            .collect();
        assert_eq!(slope(&points).map(Slope::value), Some(123_457.0));
        let s = slope(&points).map(|s| (s.num, s.den));
        assert_eq!(s, Some((123_457, 1)), "reduced");
        // Sums beyond i128 (steps 2^64 apart): no figure, and no panic.
        assert_eq!(slope(&[(0, 0), (u64::MAX, u64::MAX), (1, 0)]), None);
    }
}
