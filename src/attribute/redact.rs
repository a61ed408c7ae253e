//! Command-line redaction: what may end up in a metric label.
//!
//! Every option value is taken for a secret unless its option is on a
//! short allowlist of harmless ones ([`is_harmless_option`]: model names,
//! sizes, ports, paths of outputs and configs), because no list of secret
//! names catches `-phunter2`, `--db-pass=x` or `--key x`; and every URL
//! query value likewise unless its key is. Positional arguments stay
//! readable (a script, a subcommand, a model), except secret-looking
//! `KEY=value` assignments, URL passwords and query values, JSON, and
//! authorization headers. The corpus test (`real_command_lines`) shows what stays
//! readable of real command lines. Hand-written: no crate parses argv
//! without knowing the program's options.

/// What a redacted value is replaced with.
pub(crate) const REDACTED: &str = "<redacted>";

/// Joins a command line with spaces for display, with every value that may
/// be secret replaced by [`REDACTED`], then cut to at most `max_len`
/// characters.
///
/// Command lines end up in metric labels, which anyone who can read
/// Prometheus can see, and people do pass secrets on the command line:
/// - `--name=value`, `-name=value`: the value, unless the option is
///   harmless;
/// - `--name value`, `-n value`: the next argument, unless the option is
///   harmless, the option is a flag (`--no-…`, `--enable-…`,
///   `--disable-…`, a few known ones) or the next argument is another
///   option or a script (`train.py`); after an option with a secret name
///   (`--password`, `-pass`) the next argument even when it starts with a
///   single `-`;
/// - `-pvalue` (a short option with its value attached): all after the
///   letter;
/// - `KEY=value` with a secret-looking key (`HF_TOKEN=`, `DB_PASS=`);
/// - URL passwords (`postgres://user:<redacted>@host`) and query and
///   fragment values (`?token=<redacted>&sig=<redacted>`), unless the key
///   is harmless;
/// - an argument that is JSON (`{"password":"x"}`) or an authorization
///   header (`Authorization: Bearer x`), whole.
///
/// After `--` every argument is positional. Control characters become
/// spaces so a label stays one line. The result, including the trailing
/// `…` that marks a cut, is at most `max_len` characters (not bytes), so
/// label size is bounded.
pub(crate) fn redact_cmdline(args: &[String], max_len: usize) -> String {
    let mut out = Vec::with_capacity(args.len());
    let mut next = Next::Positional;
    let mut options_end = false;
    for (i, arg) in args.iter().enumerate() {
        if i == 0 || options_end {
            out.push(redact_positional(arg));
            continue;
        }
        let value = std::mem::replace(&mut next, Next::Positional);
        let redacted = match value {
            Next::Secret if !arg.starts_with("--") => REDACTED.to_owned(),
            Next::Value { harmless } if !looks_like_option(arg) => {
                if harmless {
                    redact_value(arg)
                } else if looks_like_script(arg) {
                    redact_positional(arg)
                } else {
                    REDACTED.to_owned()
                }
            }
            _ if arg == "--" => {
                options_end = true;
                arg.clone()
            }
            _ if looks_like_option(arg) => {
                let (shown, takes) = redact_option(arg);
                next = takes;
                shown
            }
            _ => redact_positional(arg),
        };
        out.push(redacted);
    }
    let joined: String = out
        .join(" ")
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    truncate_chars(joined, max_len)
}

/// What the argument after an option is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Not the option's (it takes none, or has its value attached).
    Positional,
    /// Its value, unless it looks like another option or a script;
    /// readable if the option is harmless.
    Value { harmless: bool },
    /// Its value even if it starts with a single `-` (a secret option's).
    Secret,
}

fn looks_like_option(arg: &str) -> bool {
    arg.len() > 1 && arg.starts_with('-')
}

/// A script or config file a launcher runs (`train.py`), which is the
/// program's, not the option's before it.
fn looks_like_script(arg: &str) -> bool {
    const EXTENSIONS: [&str; 4] = [".py", ".sh", ".ipynb", ".jl"];
    !arg.contains(['=', ':', '?', '@', ' ']) && EXTENSIONS.iter().any(|e| arg.ends_with(e))
}

/// One option (`--name`, `--name=value`, `-n`, `-nvalue`, `-name`) as
/// shown, and what the next argument is.
fn redact_option(arg: &str) -> (String, Next) {
    let long = arg.starts_with("--");
    let body = arg.trim_start_matches('-');
    let prefix = &arg[..arg.len() - body.len()];
    if let Some((name, value)) = body.split_once('=') {
        let shown = if is_harmless_option(name) {
            redact_value(value)
        } else {
            REDACTED.to_owned()
        };
        return (format!("{prefix}{name}={shown}"), Next::Positional);
    }
    if is_secret_option(body) {
        let negated = body.starts_with("no-") || body.starts_with("no_");
        return (
            arg.to_owned(),
            if negated {
                Next::Positional
            } else {
                Next::Secret
            },
        );
    }
    if is_harmless_option(body) {
        return (arg.to_owned(), Next::Value { harmless: true });
    }
    if is_flag(body) {
        return (arg.to_owned(), Next::Positional);
    }
    if !long && body.chars().count() > 1 {
        // `-pvalue`, or a single-dash long option (`-pass`, `-token`):
        // the letter, and the next argument in case it is its value.
        let letter: String = body.chars().take(1).collect();
        return (
            format!("{prefix}{letter}{REDACTED}"),
            Next::Value { harmless: false },
        );
    }
    (arg.to_owned(), Next::Value { harmless: false })
}

/// A positional argument: secret `KEY=value` assignments, JSON and
/// authorization headers redacted, URLs' passwords and query values too.
fn redact_positional(arg: &str) -> String {
    let trimmed = arg.trim_start();
    let lower = arg.to_ascii_lowercase();
    if trimmed.starts_with('{')
        || trimmed.starts_with('[')
        || lower.contains("authorization:")
        || lower.contains("bearer ")
    {
        return REDACTED.to_owned();
    }
    if let Some((key, _)) = arg.split_once('=')
        && is_secret_env_key(key)
    {
        return format!("{key}={REDACTED}");
    }
    redact_value(arg)
}

/// A value shown as is: its URLs' passwords and query values redacted, and
/// the whole of it if it is JSON or an authorization header.
fn redact_value(value: &str) -> String {
    let trimmed = value.trim_start();
    let lower = value.to_ascii_lowercase();
    if trimmed.starts_with('{') || lower.contains("authorization:") || lower.contains("bearer ") {
        return REDACTED.to_owned();
    }
    redact_query(&redact_url_passwords(value))
}

/// Normalised name parts: lower case, split at `-`, `_` and `.`.
fn name_parts(name: &str) -> Vec<String> {
    name.to_lowercase()
        .split(['-', '_', '.'])
        .filter(|part| !part.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Options whose values are kept: what says which model runs, how big, on
/// which port and where it writes, and nothing with a secret word. Matched
/// by the whole name (`_` read as `-`, case ignored) or its last part.
fn is_harmless_option(name: &str) -> bool {
    const NAMES: [&str; 22] = [
        "m",
        "jar",
        "model-name-or-path",
        "max-num-batched-tokens",
        "max-tokens",
        "max-new-tokens",
        "nproc-per-node",
        "rdzv-id",
        "rdzv-endpoint",
        "rdzv-backend",
        "master-addr",
        "main-process-ip",
        "mixed-precision",
        "num-train-epochs",
        "deepspeed",
        "deepspeed-config",
        "include",
        "exclude",
        "hostfile",
        "lr",
        "log-level",
        "subcommand",
    ];
    const LAST: [&str; 38] = [
        "file",
        "path",
        "model",
        "tokenizer",
        "revision",
        "name",
        "task",
        "dtype",
        "quantization",
        "precision",
        "config",
        "size",
        "len",
        "length",
        "seqs",
        "utilization",
        "steps",
        "epochs",
        "rate",
        "seed",
        "rank",
        "nodes",
        "nnodes",
        "gpus",
        "processes",
        "machines",
        "workers",
        "threads",
        "port",
        "host",
        "ip",
        "addr",
        "dir",
        "backend",
        "launcher",
        "device",
        "devices",
        "mode",
    ];
    if is_secret_option(name) {
        return false;
    }
    let normal = name.to_lowercase().replace('_', "-");
    let parts = name_parts(name);
    NAMES.contains(&normal.as_str())
        || parts
            .last()
            .is_some_and(|last| LAST.contains(&last.as_str()))
}

/// Options known to take no value, so the argument after them is the
/// program's: `--no-…`, `--enable-…`, `--disable-…`, and a few launchers'
/// and servers' flags.
fn is_flag(name: &str) -> bool {
    const FLAGS: [&str; 14] = [
        "standalone",
        "multi-gpu",
        "trust-remote-code",
        "enforce-eager",
        "allow-root",
        "use-env",
        "verbose",
        "help",
        "version",
        "fp16",
        "bf16",
        "do-train",
        "do-eval",
        "overwrite-output-dir",
    ];
    let normal = name.to_lowercase().replace('_', "-");
    ["no-", "enable-", "disable-"]
        .iter()
        .any(|p| normal.starts_with(p))
        || FLAGS.contains(&normal.as_str())
}

/// Whether an option's name says it holds a secret: a secret-looking name
/// ([`is_secret_name`]) or a part that is `pass`, `pwd`, `key`, `sig`,
/// `signature`, `cookie`, `session`, `private` or `bearer`.
fn is_secret_option(name: &str) -> bool {
    is_secret_name(name)
        || name_parts(name).iter().any(|p| {
            matches!(
                p.as_str(),
                "pass"
                    | "pwd"
                    | "key"
                    | "sig"
                    | "signature"
                    | "cookie"
                    | "session"
                    | "private"
                    | "bearer"
            )
        })
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
/// name, or one ending in `_KEY` / `_PASS` / `_PWD` / `_SIG`. The key must
/// look like an identifier, so that `a/b?x=y` or `x y=z` are not mistaken
/// for assignments.
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
        .is_some_and(|last| matches!(last.as_str(), "key" | "pass" | "pwd" | "sig"));
    is_secret_name(key) || last_is_secret
}

/// Replaces the value of every `key=value` after a `?` or `#` (a URL's
/// query and fragment, `&`- or `;`-separated) unless the key is harmless:
/// signed URLs carry their signature there, OAuth its tokens.
fn redact_query(s: &str) -> String {
    let Some(start) = s.find(['?', '#']) else {
        return s.to_owned();
    };
    let mut out = String::with_capacity(s.len());
    out.push_str(&s[..=start]);
    let rest = &s[start + 1..];
    for pair in rest.split_inclusive(['&', ';', '#', '?']) {
        let (body, sep) = match pair.char_indices().last() {
            Some((i, '&' | ';' | '#' | '?')) => (&pair[..i], &pair[i..]),
            _ => (pair, ""),
        };
        match body.split_once('=') {
            Some((key, _)) if !is_harmless_option(key) => {
                out.push_str(key);
                out.push('=');
                out.push_str(REDACTED);
            }
            _ => out.push_str(body),
        }
        out.push_str(sep);
    }
    out
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
                "-p is ambiguous: redacted",
                vec!["ssh", "-p", "22", "host"],
                "ssh -p <redacted> host",
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
                "--author is not on the allowlist",
                vec!["app", "--author", "alice"],
                "app --author <redacted>",
            ),
            (
                "--key is a secret option",
                vec!["app", "--key", "tls.key"],
                "app --key <redacted>",
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
                "app --db-url=<redacted>",
            ),
            (
                "url with user only",
                vec!["git", "clone", "https://user@host/r.git"],
                "git clone https://user@host/r.git",
            ),
            (
                "url without userinfo",
                vec!["curl", "https://host:8443/x?a=b"],
                "curl https://host:8443/x?a=<redacted>",
            ),
            (
                "password with @",
                vec!["app", "redis://:p@ss@cache:6379"],
                "app redis://:<redacted>@cache:6379",
            ),
            (
                "two urls in one arg",
                vec!["app", "--peers=http://a:1@h1,http://b:2@h2"],
                "app --peers=<redacted>",
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

    /// The forms that leaked verbatim when only secret-looking option
    /// names were redacted: each secret is gone.
    #[test]
    fn every_leaked_form_is_redacted() {
        let cases: [(&[&str], &str); 14] = [
            // `-pvalue` or `-pass value`: both redacted.
            (
                &["mysql", "-phunter2", "db"],
                "mysql -p<redacted> <redacted>",
            ),
            (&["mysql", "-p", "hunter2", "db"], "mysql -p <redacted> db"),
            (
                &["openssl", "enc", "-pass", "pass:hunter2", "-in", "f"],
                "openssl enc -pass <redacted> -i<redacted> <redacted>",
            ),
            (&["app", "--pass", "hunter2"], "app --pass <redacted>"),
            (&["app", "--pwd=hunter2"], "app --pwd=<redacted>"),
            (&["app", "--db-pass=hunter2"], "app --db-pass=<redacted>"),
            (
                &["app", "--private-key=hunter2"],
                "app --private-key=<redacted>",
            ),
            (&["app", "--key", "hunter2"], "app --key <redacted>"),
            (
                &["app", "--password", "-hunter2"],
                "app --password <redacted>",
            ),
            (
                &["curl", "-H", "Authorization: Bearer hunter2", "https://h/x"],
                "curl -H <redacted> https://h/x",
            ),
            (
                &["curl", "https://h/x?token=hunter2&sig=hunter3"],
                "curl https://h/x?token=<redacted>&sig=<redacted>",
            ),
            (&["app", r#"{"password":"hunter2"}"#], "app <redacted>"),
            (
                &["app", "--config-json", r#"{"password":"hunter2"}"#],
                "app --config-json <redacted>",
            ),
            (
                &["curl", "Authorization: Bearer hunter2"],
                "curl <redacted>",
            ),
        ];
        for (args, want) in cases {
            let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
            let got = redact_cmdline(&args, 1000);
            assert_eq!(got, want, "{args:?}");
            assert!(!got.contains("hunter"), "{got}");
        }
    }

    /// Real command lines of the launchers and servers that run on GPU
    /// nodes: what stays readable (models, sizes, ports, scripts,
    /// subcommands) and what does not (every other option's value).
    #[test]
    fn real_command_lines() {
        let cases: [(&str, &str); 12] = [
            (
                "torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=456 --rdzv_backend=c10d --rdzv_endpoint=10.0.0.1:29400 train.py --batch-size 32 --lr 3e-4 --wandb-key abc123",
                "torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=456 --rdzv_backend=c10d --rdzv_endpoint=10.0.0.1:29400 train.py --batch-size 32 --lr 3e-4 --wandb-key <redacted>",
            ),
            (
                "torchrun --standalone --nproc-per-node 4 finetune.py --model_name_or_path meta-llama/Llama-2-7b-hf --output_dir /ckpt --hf_token hf_abc123",
                "torchrun --standalone --nproc-per-node 4 finetune.py --model_name_or_path meta-llama/Llama-2-7b-hf --output_dir /ckpt --hf_token <redacted>",
            ),
            (
                "vllm serve meta-llama/Meta-Llama-3-8B-Instruct --tensor-parallel-size 2 --gpu-memory-utilization 0.9 --max-model-len 8192 --port 8000 --api-key sk-abc123 --enable-prefix-caching",
                "vllm serve meta-llama/Meta-Llama-3-8B-Instruct --tensor-parallel-size 2 --gpu-memory-utilization 0.9 --max-model-len 8192 --port 8000 --api-key <redacted> --enable-prefix-caching",
            ),
            (
                "python3 -m vllm.entrypoints.openai.api_server --model mistralai/Mistral-7B-v0.1 --dtype bfloat16 --served-model-name mistral --host 0.0.0.0 --max-num-seqs 64",
                "python3 -m vllm.entrypoints.openai.api_server --model mistralai/Mistral-7B-v0.1 --dtype bfloat16 --served-model-name mistral --host 0.0.0.0 --max-num-seqs 64",
            ),
            (
                "deepspeed --num_gpus 8 --master_port 29501 train.py --deepspeed ds_config.json --per_device_train_batch_size 4 --gradient_accumulation_steps 8",
                "deepspeed --num_gpus 8 --master_port 29501 train.py --deepspeed ds_config.json --per_device_train_batch_size 4 --gradient_accumulation_steps 8",
            ),
            (
                "deepspeed --hostfile /job/hostfile --include localhost:0,1 pretrain.py --data-path s3://bucket/data?X-Amz-Signature=abc123",
                "deepspeed --hostfile /job/hostfile --include localhost:0,1 pretrain.py --data-path s3://bucket/data?X-Amz-Signature=<redacted>",
            ),
            (
                "accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 train.py --model_name_or_path gpt2 --push_to_hub_token abc123",
                "accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 train.py --model_name_or_path gpt2 --push_to_hub_token <redacted>",
            ),
            (
                "accelerate launch --config_file /cfg/fsdp.yaml --main_process_port 29500 sft.py",
                "accelerate launch --config_file /cfg/fsdp.yaml --main_process_port 29500 sft.py",
            ),
            (
                "jupyter lab --ip=0.0.0.0 --port=8888 --no-browser --allow-root --ServerApp.token=abc123 --notebook-dir=/work",
                "jupyter lab --ip=0.0.0.0 --port=8888 --no-browser --allow-root --ServerApp.token=<redacted> --notebook-dir=/work",
            ),
            (
                "python -u -m torch.distributed.run --nproc_per_node 2 main.py --resume s3://ckpt/last.pt",
                "python -u -m torch.distributed.run --nproc_per_node 2 main.py --resume <redacted>",
            ),
            (
                "python train.py --epochs 3 --seed 42 --wandb_project llm --run_name sweep-1",
                "python train.py --epochs 3 --seed 42 --wandb_project <redacted> --run_name sweep-1",
            ),
            (
                "python -c import os; print(os.environ) -- --token abc123",
                "python -c <redacted> os; print(os.environ) -- --token abc123",
            ),
        ];
        for (line, want) in cases {
            let args: Vec<String> = line.split(' ').map(str::to_owned).collect();
            assert_eq!(redact_cmdline(&args, 1000), want, "{line}");
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
