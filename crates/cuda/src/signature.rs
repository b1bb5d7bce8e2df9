//! Kernel signatures: what each PTX entry takes, declared once in Rust and
//! checked against the PTX text.
//!
//! The launchers build their argument lists from these declarations, and
//! [`PtxModule::verify`] parses the module's PTX text and compares every
//! `.entry` and its `.param` list with them, in both directions. This part of
//! the crate needs no GPU and no driver, so the check runs in plain `cargo test`.

use crate::error::{Error, Result};

/// The kind of one kernel parameter, as declared in PTX.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Param {
    /// `.param .u64`: a device pointer.
    Ptr,
    /// `.param .u32`: a size, an index or a 0/1 flag.
    U32,
    /// `.param .f32`: a scalar such as a learning rate or a scale.
    F32,
}

impl Param {
    /// The PTX type name of this kind (`.u64`, `.u32`, `.f32`).
    pub fn ptx_type(self) -> &'static str {
        match self {
            Param::Ptr => ".u64",
            Param::U32 => ".u32",
            Param::F32 => ".f32",
        }
    }

    fn from_ptx_type(ty: &str) -> Option<Param> {
        match ty {
            ".u64" => Some(Param::Ptr),
            ".u32" => Some(Param::U32),
            ".f32" => Some(Param::F32),
            _ => None,
        }
    }
}

/// One kernel: its PTX entry name and its ordered parameter kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSignature {
    /// The `.entry` name, which is also the name of the CPU twin (or starts with it).
    pub name: &'static str,
    /// Parameter kinds in PTX order.
    pub params: &'static [Param],
}

/// One PTX file: its text (embedded with `include_str!`) and its kernels.
#[derive(Clone, Copy, Debug)]
pub struct PtxModule {
    /// Short name (`"lstm"`), also the key of the per-context module cache.
    pub name: &'static str,
    /// Path of the file in the repository (`"ptx/lstm.ptx"`).
    pub file: &'static str,
    /// The PTX text.
    pub text: &'static str,
    /// Every entry of the file, declared.
    pub kernels: &'static [KernelSignature],
}

impl PtxModule {
    /// The declared signature of `kernel`, or [`Error::UnknownKernel`].
    pub fn kernel(&self, kernel: &str) -> Result<&'static KernelSignature> {
        self.kernels
            .iter()
            .find(|k| k.name == kernel)
            .ok_or_else(|| Error::UnknownKernel {
                module: self.name,
                kernel: kernel.to_string(),
            })
    }

    /// Parses the PTX text and checks that its entries and the declarations
    /// agree exactly: every entry declared, every declaration present, same
    /// parameter kinds in the same order.
    pub fn verify(&self) -> Result<()> {
        let entries = parse_ptx_entries_in(self.file, self.text)?;
        compare_entries(self.kernels, &entries)
    }
}

/// An entry found in PTX text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedEntry {
    /// The `.entry` name.
    pub name: String,
    /// Its parameter kinds in order.
    pub params: Vec<Param>,
    /// 1-based line of the `.entry` directive.
    pub line: usize,
}

/// Parses every `.entry NAME(.param .TYPE name, ...)` in `text`.
///
/// Comments (`//` and `/* */`) are ignored. Parameter types other than `.u64`,
/// `.u32` and `.f32` are an error (the launchers can pass no other kind).
pub fn parse_ptx_entries(text: &str) -> Result<Vec<ParsedEntry>> {
    parse_ptx_entries_in("<text>", text)
}

fn parse_error(file: &str, line: usize, reason: String) -> Error {
    Error::PtxParse {
        file: file.to_string(),
        line,
        reason,
    }
}

/// Replaces comments with spaces, keeping newlines so line numbers survive.
fn strip_comments(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'/' && bytes.get(i + 1) == Some(&b'/') {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
        } else if bytes[i] == b'/' && bytes.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < bytes.len() && !(bytes[i] == b'*' && bytes.get(i + 1) == Some(&b'/')) {
                if bytes[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 2;
            out.push(' ');
        } else {
            // Copy one whole character (PTX is ASCII, but stay UTF-8 safe).
            let ch = text[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '$'
}

fn parse_ptx_entries_in(file: &str, text: &str) -> Result<Vec<ParsedEntry>> {
    let clean = strip_comments(text);
    let line_of = |pos: usize| clean[..pos].matches('\n').count() + 1;
    let mut entries = Vec::new();
    let mut search_from = 0;
    while let Some(found) = clean[search_from..].find(".entry") {
        let at = search_from + found;
        let after = at + ".entry".len();
        search_from = after;
        // `.entry` must stand alone (not part of a longer word).
        let before_ok = at == 0 || !is_ident_char(clean[..at].chars().next_back().unwrap_or(' '));
        let after_ok = clean[after..].starts_with(|c: char| c.is_whitespace());
        if !before_ok || !after_ok {
            continue;
        }
        let line = line_of(at);
        let rest = clean[after..].trim_start();
        let name_len = rest.find(|c: char| !is_ident_char(c)).unwrap_or(rest.len());
        if name_len == 0 {
            return Err(parse_error(file, line, "`.entry` without a name".into()));
        }
        let name = rest[..name_len].to_string();
        let rest = rest[name_len..].trim_start();
        let mut params = Vec::new();
        if let Some(list) = rest.strip_prefix('(') {
            let close = list.find(')').ok_or_else(|| {
                parse_error(
                    file,
                    line,
                    format!("entry `{name}`: parameter list has no `)`"),
                )
            })?;
            for decl in list[..close].split(',') {
                let decl = decl.trim();
                if decl.is_empty() {
                    continue;
                }
                let mut tokens = decl.split_whitespace();
                if tokens.next() != Some(".param") {
                    return Err(parse_error(
                        file,
                        line,
                        format!("entry `{name}`: `{decl}` is not a `.param` declaration"),
                    ));
                }
                let ty = tokens
                    .find(|t| t.starts_with('.') && *t != ".align" && *t != ".ptr")
                    .ok_or_else(|| {
                        parse_error(file, line, format!("entry `{name}`: `{decl}` has no type"))
                    })?;
                let kind = Param::from_ptx_type(ty).ok_or_else(|| {
                    parse_error(
                        file,
                        line,
                        format!(
                            "entry `{name}`: parameter `{decl}` has type `{ty}`; launchers pass only .u64, .u32 and .f32"
                        ),
                    )
                })?;
                params.push(kind);
            }
            search_from = clean.len() - list.len() + close;
        }
        entries.push(ParsedEntry { name, params, line });
    }
    Ok(entries)
}

fn format_params(params: &[Param]) -> String {
    let names: Vec<&str> = params.iter().map(|p| p.ptx_type()).collect();
    format!("({})", names.join(", "))
}

/// Compares declarations with parsed entries; the error lists every difference.
pub fn compare_entries(declared: &[KernelSignature], parsed: &[ParsedEntry]) -> Result<()> {
    let mut problems = Vec::new();
    for (i, entry) in parsed.iter().enumerate() {
        if parsed[..i].iter().any(|e| e.name == entry.name) {
            problems.push(format!(
                "entry `{}` appears more than once in the PTX",
                entry.name
            ));
            continue;
        }
        match declared.iter().find(|d| d.name == entry.name) {
            None => problems.push(format!(
                "PTX entry `{}` (line {}) has no declaration in the launcher module",
                entry.name, entry.line
            )),
            Some(d) if d.params != entry.params.as_slice() => problems.push(format!(
                "`{}`: PTX declares {} but the launcher declares {}",
                entry.name,
                format_params(&entry.params),
                format_params(d.params)
            )),
            Some(_) => {}
        }
    }
    for d in declared {
        if !parsed.iter().any(|e| e.name == d.name) {
            problems.push(format!(
                "declared kernel `{}` has no `.entry` in the PTX",
                d.name
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::SignatureMismatch {
            kernel: problems.len().to_string() + " problem(s)",
            reason: problems.join("; "),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
// .entry commented_out(.param .u64 x)
.version 8.0
.target sm_80
/* a block comment
   .entry also_commented(.param .u32 n) */
.visible .entry first(
    .param .u64 first_a,
    .param .u32 first_n,   // trailing comment
    .param .f32 first_alpha
)
{ ret; }
.visible .entry second() { ret; }
.entry third(.param .align 8 .u64 p) { ret; }
"#;

    #[test]
    fn parses_entries_params_and_lines() {
        let entries = parse_ptx_entries(SAMPLE).unwrap();
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["first", "second", "third"]);
        assert_eq!(entries[0].params, [Param::Ptr, Param::U32, Param::F32]);
        assert_eq!(entries[0].line, 7);
        assert!(entries[1].params.is_empty());
        assert_eq!(entries[2].params, [Param::Ptr]);
    }

    #[test]
    fn rejects_unsupported_param_types() {
        let err = parse_ptx_entries(".entry k(.param .f64 x) {}").unwrap_err();
        assert!(err.to_string().contains(".f64"), "{err}");
    }

    #[test]
    fn comparison_reports_every_kind_of_difference() {
        let parsed = parse_ptx_entries(SAMPLE).unwrap();
        let ok = [
            KernelSignature {
                name: "first",
                params: &[Param::Ptr, Param::U32, Param::F32],
            },
            KernelSignature {
                name: "second",
                params: &[],
            },
            KernelSignature {
                name: "third",
                params: &[Param::Ptr],
            },
        ];
        compare_entries(&ok, &parsed).unwrap();

        let wrong_order = [
            KernelSignature {
                name: "first",
                params: &[Param::Ptr, Param::F32, Param::U32],
            },
            ok[1],
            ok[2],
        ];
        let msg = compare_entries(&wrong_order, &parsed)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`first`: PTX declares (.u64, .u32, .f32)"),
            "{msg}"
        );

        let missing_decl = [ok[0], ok[1]];
        let msg = compare_entries(&missing_decl, &parsed)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("PTX entry `third`"), "{msg}");

        let extra_decl = [
            ok[0],
            ok[1],
            ok[2],
            KernelSignature {
                name: "fourth",
                params: &[],
            },
        ];
        let msg = compare_entries(&extra_decl, &parsed)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`fourth` has no `.entry`"), "{msg}");
    }
}
