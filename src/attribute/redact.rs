//! Command-line redaction: what may end up in a metric label.

/// What a redacted value is replaced with.
pub(crate) const REDACTED: &str = "<redacted>";

/// Joins a command line with spaces for display, with secret-looking values
/// replaced by [`REDACTED`], then cut to at most `max_len` characters.
///
/// Command lines end up in metric labels, which anyone who can read Prometheus
/// can see, and people do pass tokens on the command line. Redacted:
/// - options whose name has a secret-looking word (`--password=x`,
///   `--token x`, `--api-key`, `--auth`, `-Dssl.keyStorePassword=x`); the
///   words are matched per `-`/`_`/`.`-separated part, so `--tokenizer` and
///   `--max-num-batched-tokens` keep their (useful) values;
/// - `KEY=value` arguments with a secret-looking key (`HF_TOKEN=`,
///   `AWS_SECRET_ACCESS_KEY=`, `DB_PASSWORD=`, `api_key=`);
/// - the password of URLs with userinfo (`postgres://user:<redacted>@host`).
///
/// A secret option without `=` redacts the next argument unless that looks
/// like an option itself (`--use-auth-token --model x` keeps `--model`).
/// Control characters become spaces so a label stays one line. The result,
/// including the trailing `…` that marks a cut, is at most `max_len`
/// characters (not bytes), so label size is bounded.
pub(crate) fn redact_cmdline(args: &[String], max_len: usize) -> String {
    let mut out = Vec::with_capacity(args.len());
    let mut value_expected = false;
    for arg in args {
        if std::mem::take(&mut value_expected) && !looks_like_option(arg) {
            out.push(REDACTED.to_owned());
            continue;
        }
        let (redacted, takes_value) = redact_arg(arg);
        value_expected = takes_value;
        out.push(redacted);
    }
    let joined: String = out
        .join(" ")
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    truncate_chars(joined, max_len)
}

fn looks_like_option(arg: &str) -> bool {
    arg.len() > 1 && arg.starts_with('-')
}

/// Redacts one argument; the flag says whether the next argument is this
/// option's (secret) value.
fn redact_arg(arg: &str) -> (String, bool) {
    if let Some(option) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) {
        let prefix = &arg[..arg.len() - option.len()];
        match option.split_once('=') {
            Some((name, _)) if is_secret_name(name) => {
                return (format!("{prefix}{name}={REDACTED}"), false);
            }
            None if is_secret_name(option) => {
                let negated = option.starts_with("no-") || option.starts_with("no_");
                return (arg.to_owned(), !negated);
            }
            _ => {}
        }
    } else if let Some((key, _)) = arg.split_once('=')
        && is_secret_env_key(key)
    {
        return (format!("{key}={REDACTED}"), false);
    }
    (redact_url_passwords(arg), false)
}

fn name_parts(name: &str) -> Vec<String> {
    name.to_lowercase()
        .split(['-', '_', '.'])
        .filter(|part| !part.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Whether an option or key name looks like it holds a secret, judged per
/// separated part: `auth` must be a whole part (not `author`), the others may
/// end a part (`dbpassword`, `keystorepassword`, `hftoken`).
fn is_secret_name(name: &str) -> bool {
    const ENDINGS: [&str; 9] = [
        "password",
        "passwd",
        "secret",
        "secrets",
        "token",
        "credential",
        "credentials",
        "apikey",
        "accesskey",
    ];
    let parts = name_parts(name);
    let word = parts
        .iter()
        .any(|part| part == "auth" || ENDINGS.iter().any(|end| part.ends_with(end)));
    let pair = parts
        .windows(2)
        .any(|pair| matches!(pair[0].as_str(), "api" | "access" | "secret") && pair[1] == "key");
    word || pair
}

/// Whether the key of a `KEY=value` argument looks secret: a secret-looking
/// name, or one ending in `_KEY` / `_PASS` / `_PWD`. The key must look like an
/// identifier, so that `a/b?x=y` or `x y=z` are not mistaken for assignments.
fn is_secret_env_key(key: &str) -> bool {
    let identifier = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if !identifier {
        return false;
    }
    let last_is_secret = name_parts(key)
        .last()
        .is_some_and(|last| matches!(last.as_str(), "key" | "pass" | "pwd"));
    is_secret_name(key) || last_is_secret
}

/// Replaces the password in every `scheme://user:password@host` of `s`. The
/// authority ends at `/`, `?`, `#`, `,` or whitespace; the LAST `@` in it ends
/// the userinfo, because unencoded passwords do contain `@`.
fn redact_url_passwords(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(scheme_end) = rest.find("://") {
        let authority_start = scheme_end + "://".len();
        out.push_str(&rest[..authority_start]);
        let after = &rest[authority_start..];
        let end = after
            .find(|c: char| matches!(c, '/' | '?' | '#' | ',') || c.is_whitespace())
            .unwrap_or(after.len());
        let authority = &after[..end];
        match authority.rsplit_once('@') {
            Some((userinfo, host)) if userinfo.contains(':') => {
                let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                out.push_str(user);
                out.push(':');
                out.push_str(REDACTED);
                out.push('@');
                out.push_str(host);
            }
            _ => out.push_str(authority),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// Cuts `s` to at most `max_len` characters, the last being `…` when cut.
fn truncate_chars(s: String, max_len: usize) -> String {
    if s.chars().count() <= max_len {
        return s;
    }
    if max_len == 0 {
        return String::new();
    }
    let cut = s
        .char_indices()
        .nth(max_len - 1)
        .map_or(s.len(), |(index, _)| index);
    let mut truncated = s[..cut].to_owned();
    truncated.push('…');
    truncated
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_cmdline_table() {
        let cases: Vec<(&str, Vec<&str>, &str)> = vec![
            (
                "nothing to redact",
                vec!["python3", "train.py", "--lr", "0.1"],
                "python3 train.py --lr 0.1",
            ),
            ("empty", vec![], ""),
            // long options, inline value
            (
                "--password=",
                vec!["app", "--password=hunter2"],
                "app --password=<redacted>",
            ),
            (
                "--passwd=",
                vec!["app", "--passwd=hunter2"],
                "app --passwd=<redacted>",
            ),
            (
                "--token=",
                vec!["app", "--token=abc"],
                "app --token=<redacted>",
            ),
            (
                "--api-key=",
                vec!["app", "--api-key=abc"],
                "app --api-key=<redacted>",
            ),
            (
                "--api_key=",
                vec!["app", "--api_key=abc"],
                "app --api_key=<redacted>",
            ),
            (
                "--apikey=",
                vec!["app", "--apikey=abc"],
                "app --apikey=<redacted>",
            ),
            (
                "--secret=",
                vec!["app", "--secret=abc"],
                "app --secret=<redacted>",
            ),
            (
                "--client-secret=",
                vec!["app", "--client-secret=abc"],
                "app --client-secret=<redacted>",
            ),
            (
                "--auth=",
                vec!["app", "--auth=user:pw"],
                "app --auth=<redacted>",
            ),
            (
                "--access-key=",
                vec!["app", "--access-key=AKIA"],
                "app --access-key=<redacted>",
            ),
            (
                "--credentials=",
                vec!["app", "--credentials=abc"],
                "app --credentials=<redacted>",
            ),
            (
                "--hf-token=",
                vec!["app", "--hf-token=hf_abc"],
                "app --hf-token=<redacted>",
            ),
            (
                "--DB-PASSWORD= (case)",
                vec!["app", "--DB-PASSWORD=x"],
                "app --DB-PASSWORD=<redacted>",
            ),
            (
                "--password= empty value",
                vec!["app", "--password="],
                "app --password=<redacted>",
            ),
            // long options, separate value
            (
                "--password x",
                vec!["app", "--password", "hunter2", "-v"],
                "app --password <redacted> -v",
            ),
            (
                "--token x",
                vec!["app", "--token", "abc"],
                "app --token <redacted>",
            ),
            (
                "--api-key x",
                vec!["app", "--api-key", "abc", "serve"],
                "app --api-key <redacted> serve",
            ),
            ("secret option last", vec!["app", "--token"], "app --token"),
            (
                "flag-like secret option followed by option",
                vec!["run", "--use-auth-token", "--model", "llama"],
                "run --use-auth-token --model llama",
            ),
            (
                "negated flag takes no value",
                vec!["app", "--no-auth", "data.csv"],
                "app --no-auth data.csv",
            ),
            (
                "value '-' is redacted",
                vec!["app", "--password", "-"],
                "app --password <redacted>",
            ),
            // single-dash (Go flags, Java properties)
            (
                "-token=",
                vec!["app", "-token=abc"],
                "app -token=<redacted>",
            ),
            (
                "-token x",
                vec!["app", "-token", "abc"],
                "app -token <redacted>",
            ),
            (
                "java property",
                vec![
                    "java",
                    "-Djavax.net.ssl.keyStorePassword=changeit",
                    "-jar",
                    "x.jar",
                ],
                "java -Djavax.net.ssl.keyStorePassword=<redacted> -jar x.jar",
            ),
            // not secrets
            (
                "-p is ambiguous",
                vec!["ssh", "-p", "22", "host"],
                "ssh -p 22 host",
            ),
            (
                "--tokenizer keeps its value",
                vec!["vllm", "--tokenizer", "meta/llama"],
                "vllm --tokenizer meta/llama",
            ),
            (
                "--max-num-batched-tokens keeps its value",
                vec!["vllm", "--max-num-batched-tokens", "8192"],
                "vllm --max-num-batched-tokens 8192",
            ),
            (
                "--author keeps its value",
                vec!["app", "--author", "alice"],
                "app --author alice",
            ),
            (
                "--key is ambiguous",
                vec!["app", "--key", "tls.key"],
                "app --key tls.key",
            ),
            (
                "max_tokens=",
                vec!["app", "max_tokens=100"],
                "app max_tokens=100",
            ),
            (
                "KEY_PATH=",
                vec!["app", "KEY_PATH=/etc/k"],
                "app KEY_PATH=/etc/k",
            ),
            ("MONKEY=", vec!["app", "MONKEY=1"], "app MONKEY=1"),
            // env-style
            (
                "FOO_KEY=",
                vec!["env", "FOO_KEY=abc", "app"],
                "env FOO_KEY=<redacted> app",
            ),
            (
                "HF_TOKEN=",
                vec!["env", "HF_TOKEN=hf_abc"],
                "env HF_TOKEN=<redacted>",
            ),
            (
                "*_SECRET=",
                vec!["env", "CLIENT_SECRET=abc"],
                "env CLIENT_SECRET=<redacted>",
            ),
            (
                "*_PASSWORD=",
                vec!["env", "DB_PASSWORD=abc"],
                "env DB_PASSWORD=<redacted>",
            ),
            (
                "*_PASS=",
                vec!["env", "DB_PASS=abc"],
                "env DB_PASS=<redacted>",
            ),
            (
                "AWS_SECRET_ACCESS_KEY=",
                vec!["env", "AWS_SECRET_ACCESS_KEY=abc"],
                "env AWS_SECRET_ACCESS_KEY=<redacted>",
            ),
            (
                "SECRET_KEY_BASE=",
                vec!["env", "SECRET_KEY_BASE=abc"],
                "env SECRET_KEY_BASE=<redacted>",
            ),
            (
                "hydra override",
                vec!["python", "x.py", "model.api_key=abc"],
                "python x.py model.api_key=<redacted>",
            ),
            (
                "value containing '='",
                vec!["env", "TOKEN=a=b=c"],
                "env TOKEN=<redacted>",
            ),
            // URLs
            (
                "url with password",
                vec!["app", "postgres://user:hunter2@db:5432/x"],
                "app postgres://user:<redacted>@db:5432/x",
            ),
            (
                "url in option value",
                vec!["app", "--db-url=mysql://root:pw@localhost/db"],
                "app --db-url=mysql://root:<redacted>@localhost/db",
            ),
            (
                "url with user only",
                vec!["git", "clone", "https://user@host/r.git"],
                "git clone https://user@host/r.git",
            ),
            (
                "url without userinfo",
                vec!["curl", "https://host:8443/x?a=b"],
                "curl https://host:8443/x?a=b",
            ),
            (
                "password with @",
                vec!["app", "redis://:p@ss@cache:6379"],
                "app redis://:<redacted>@cache:6379",
            ),
            (
                "two urls in one arg",
                vec!["app", "--peers=http://a:1@h1,http://b:2@h2"],
                "app --peers=http://a:<redacted>@h1,http://b:<redacted>@h2",
            ),
            (
                "bare scheme separator",
                vec!["app", "://", "x://"],
                "app :// x://",
            ),
            // display hygiene
            (
                "control chars become spaces",
                vec!["a\nb", "c\td"],
                "a b c d",
            ),
        ];
        for (name, args, expected) in cases {
            let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
            assert_eq!(redact_cmdline(&args, 1000), expected, "case {name:?}");
        }
    }

    #[test]
    fn redact_cmdline_truncates_on_char_boundaries() {
        let args = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let cases: Vec<(Vec<String>, usize, &str)> = vec![
            (args(&["abc", "def"]), 7, "abc def"),
            (args(&["abc", "def"]), 100, "abc def"),
            (args(&["abc", "def"]), 6, "abc d…"),
            (args(&["abc", "def"]), 1, "…"),
            (args(&["abc", "def"]), 0, ""),
            (args(&[]), 0, ""),
            (args(&["日本語テキスト"]), 4, "日本語…"),
            (args(&["日本語"]), 3, "日本語"),
            (args(&["🎉🎉🎉🎉"]), 2, "🎉…"),
            (args(&["app", "--token=abcdef"]), 14, "app --token=<…"),
        ];
        for (args, max_len, expected) in cases {
            let got = redact_cmdline(&args, max_len);
            assert_eq!(got, expected, "args {args:?} max_len {max_len}");
            assert!(got.chars().count() <= max_len);
        }
    }
}
