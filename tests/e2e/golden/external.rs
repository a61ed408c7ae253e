//! The fixtures read by the strict parsers of Python's prometheus_client
//! (`--features external-tools`).

use gpumem_exporter::testing::expose::Format;

use super::encoded;
use crate::harness::tools::assert_strict_parsers_accept;

/// The strict parsers of Python's prometheus_client read both fixtures,
/// every sample of them.
#[test]
fn strict_parsers_accept_the_fixtures() {
    assert_strict_parsers_accept(&encoded(Format::Text), &encoded(Format::OpenMetrics));
}
