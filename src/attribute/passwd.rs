//! uid → user name from the host's passwd file (read once, lazily).

use std::collections::HashMap;
use std::fs;
use std::path::PathBuf;
use std::sync::OnceLock;

/// uid → user name from passwd-format content. Comments, blank lines, NIS
/// compat entries (`+`/`-`) and lines without a numeric uid are skipped; when
/// a uid appears twice the first name wins, as with `getpwuid`.
pub(crate) fn parse_passwd(content: &str) -> HashMap<u32, String> {
    let mut names = HashMap::new();
    for line in content.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut fields = line.split(':');
        let (Some(name), Some(_password), Some(uid)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if name.is_empty() || name.starts_with(['+', '-']) {
            continue;
        }
        let Ok(uid) = uid.parse::<u32>() else {
            continue;
        };
        names.entry(uid).or_insert_with(|| name.to_owned());
    }
    names
}

/// uid → user name, from one passwd file read at most once.
///
/// The file is read directly instead of through NSS (`getpwuid`): in a
/// container the exporter's own `/etc/passwd` is not the host's, so the host
/// file is mounted (e.g. `/host/etc/passwd`) and named here. It is read once,
/// lazily, because users change rarely and re-reading per process per tick is
/// waste; a user added later shows as a numeric uid until restart. LDAP/SSSD
/// users are not in the file and show as numeric uids too.
#[derive(Debug)]
pub struct UserNames {
    path: PathBuf,
    names: OnceLock<HashMap<u32, String>>,
}

impl UserNames {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            names: OnceLock::new(),
        }
    }

    /// From passwd content already in hand (tests, or a caller that read it).
    pub fn from_passwd(content: &str) -> Self {
        Self {
            path: PathBuf::new(),
            names: OnceLock::from(parse_passwd(content)),
        }
    }

    /// The user name, or the uid in decimal when unknown or unreadable, so a
    /// label always has a value that still identifies the user.
    pub fn name(&self, uid: u32) -> String {
        self.names()
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }

    fn names(&self) -> &HashMap<u32, String> {
        self.names.get_or_init(|| {
            fs::read(&self.path)
                .map(|bytes| parse_passwd(&String::from_utf8_lossy(&bytes)))
                .unwrap_or_default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_passwd_table() {
        type Case<'a> = (&'a str, &'a str, Vec<(u32, &'a str)>);
        let cases: Vec<Case<'_>> = vec![
            (
                "typical",
                "root:x:0:0:root:/root:/bin/bash\n\
                 daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n\
                 alice:x:1000:1000:Alice,,,:/home/alice:/bin/bash\n",
                vec![(0, "root"), (1, "daemon"), (1000, "alice")],
            ),
            (
                "comments, blanks, CRLF",
                "# comment\n\n  \nbob:x:1001:1001::/home/bob:/bin/sh\r\n",
                vec![(1001, "bob")],
            ),
            (
                "malformed lines skipped",
                "nouid:x\n:x:5:5::/:/bin/sh\ncarol:x:notanumber:1::/:/bin/sh\n\
                 dave:x:-1:1::/:/bin/sh\nerin:x:4294967296:1::/:/bin/sh\nfrank:x:7:7\n",
                vec![(7, "frank")],
            ),
            (
                "NIS compat entries skipped",
                "+::::::\n-baduser:x:9:9::/:/bin/sh\n+@group:x:10:10::/:/bin/sh\n",
                vec![],
            ),
            (
                "duplicate uid: first wins",
                "toor:x:0:0::/root:/bin/sh\nroot:x:0:0::/root:/bin/sh\n",
                vec![(0, "toor")],
            ),
            (
                "max uid",
                "nobody4:x:4294967295:1::/:/bin/sh",
                vec![(4294967295, "nobody4")],
            ),
            ("empty", "", vec![]),
        ];
        for (name, input, expected) in cases {
            let expected: HashMap<u32, String> = expected
                .into_iter()
                .map(|(uid, name)| (uid, name.to_owned()))
                .collect();
            assert_eq!(parse_passwd(input), expected, "case {name:?}");
        }
    }

    #[test]
    fn user_names_reads_once_and_falls_back_to_uid() {
        let dir = tempfile::tempdir().unwrap();
        let passwd = dir.path().join("passwd");
        fs::write(
            &passwd,
            b"root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n",
        )
        .unwrap();
        let users = UserNames::new(&passwd);
        assert_eq!(users.name(1000), "alice");
        assert_eq!(users.name(0), "root");
        assert_eq!(users.name(4242), "4242");

        // Loaded once: later edits are not seen.
        fs::write(&passwd, b"mallory:x:1000:1000::/:/bin/sh\n").unwrap();
        assert_eq!(users.name(1000), "alice");

        let missing = UserNames::new(dir.path().join("does/not/exist"));
        assert_eq!(missing.name(0), "0");
        assert_eq!(missing.name(1000), "1000");

        let in_hand = UserNames::from_passwd("bob:x:1001:1001::/:/bin/sh");
        assert_eq!(in_hand.name(1001), "bob");
        assert_eq!(in_hand.name(1002), "1002");
    }
}
