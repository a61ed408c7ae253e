//! A Kubernetes `Quantity` (`40Gi`, `42949672960`, `1.5G`, `4e9`) as a
//! whole number of bytes, for a DRA claim's consumed memory.
//!
//! Written by hand: k8s-openapi keeps a quantity as its string, and no
//! maintained crate parses one without pulling in a decimal library; the
//! grammar is the API's (`k8s.io/apimachinery/pkg/api/resource`), with its
//! rounding up to a whole number (`Quantity.Value()`).

/// The longest quantity read.
const MAX_LEN: usize = 64;
/// The most digits read in a number: beyond, a memory size is nonsense.
const MAX_DIGITS: usize = 30;

/// `q` in bytes, rounded up; `None` for a negative, malformed or too
/// large quantity.
pub(crate) fn bytes(q: &str) -> Option<u64> {
    if q.is_empty() || q.len() > MAX_LEN {
        return None;
    }
    let unsigned = q.strip_prefix('+').unwrap_or(q);
    let split = unsigned
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(unsigned.len());
    let (number, suffix) = unsigned.split_at(split);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty()
        || fraction.contains('.')
        || whole.len() + fraction.len() > MAX_DIGITS
    {
        return None;
    }
    // The number is `mantissa / 10^fraction.len()`.
    let mut mantissa: u128 = 0;
    for b in whole.bytes().chain(fraction.bytes()) {
        mantissa = mantissa * 10 + u128::from(b - b'0');
    }
    let (power_of_two, power_of_ten): (u32, i32) = match suffix {
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
        "n" => (0, -9),
        "u" => (0, -6),
        "m" => (0, -3),
        "" => (0, 0),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        s => {
            let e = s.strip_prefix(['e', 'E'])?;
            let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
            if digits.is_empty() || digits.len() > 3 || !digits.bytes().all(|b| b.is_ascii_digit())
            {
                return None;
            }
            (0, e.parse::<i32>().ok()?)
        }
    };
    // The scale: bytes = mantissa × 2^p2 × 10^up / 10^down.
    let exponent = power_of_ten - i32::try_from(fraction.len()).ok()?;
    let (up, down) = if exponent >= 0 {
        (exponent.unsigned_abs(), 0)
    } else {
        (0, exponent.unsigned_abs())
    };
    let numerator = mantissa
        .checked_mul(1u128.checked_shl(power_of_two)?)?
        .checked_mul(10u128.checked_pow(up)?)?;
    let value = match 10u128.checked_pow(down) {
        Some(d) => numerator.div_ceil(d),
        // Smaller than a byte, but not nothing.
        None => u128::from(numerator > 0),
    };
    u64::try_from(value).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_in_bytes() {
        const GI: u64 = 1 << 30;
        let cases: &[(&str, Option<u64>)] = &[
            ("40Gi", Some(40 * GI)),
            ("42949672960", Some(40 * GI)),
            ("+40Gi", Some(40 * GI)),
            ("1.5Gi", Some(3 * GI / 2)),
            ("0.5Ki", Some(512)),
            (".5Ki", Some(512)),
            ("5.Ki", Some(5120)),
            ("20G", Some(20_000_000_000)),
            ("20000M", Some(20_000_000_000)),
            ("1k", Some(1000)),
            ("1Ti", Some(1 << 40)),
            ("1Ei", Some(1 << 60)),
            ("2e9", Some(2_000_000_000)),
            ("2E9", Some(2_000_000_000)),
            ("2e+9", Some(2_000_000_000)),
            ("25e-1", Some(3)),
            ("100m", Some(1)),
            ("1n", Some(1)),
            ("1e-999", Some(1)),
            ("0", Some(0)),
            ("0Gi", Some(0)),
            ("0.0", Some(0)),
            ("16Ei", None),
            ("18446744073709551615", Some(u64::MAX)),
            ("18446744073709551616", None),
            ("1e1000", None),
            ("1000000000000000000000000000000000000Ei", None),
            ("-1Gi", None),
            ("", None),
            ("Gi", None),
            (".", None),
            ("+", None),
            ("1.2.3", None),
            ("1Gib", None),
            ("1 Gi", None),
            (" 1Gi", None),
            ("1gi", None),
            ("1e", None),
            ("1e+", None),
            ("1e1.5", None),
            ("0x10", None),
            ("1Gi\u{0}", None),
        ];
        for (q, want) in cases {
            assert_eq!(bytes(q), *want, "{q:?}");
        }
        assert_eq!(bytes(&"1".repeat(MAX_LEN + 1)), None);
    }
}
