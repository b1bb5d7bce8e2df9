//! Every `.entry` in every `ptx/*.ptx` file matches its launcher declaration
//! (name, parameter kinds, order), in both directions, and every file obeys the
//! portability rules (PTX ISA 9.0 or lower, `.target sm_80`). Needs no GPU.

use std::path::PathBuf;

use ringtrain_cuda::{parse_ptx_entries, Param, MODULES};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn every_entry_matches_its_declaration() {
    let mut failures = Vec::new();
    for module in MODULES {
        if let Err(e) = module.verify() {
            failures.push(format!("{}: {e}", module.file));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_ptx_file_has_a_module_and_the_embedded_text_is_current() {
    let dir = repo_root().join("ptx");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".ptx"))
        .collect();
    files.sort();
    let declared: Vec<String> = MODULES
        .iter()
        .map(|m| m.file.trim_start_matches("ptx/").to_string())
        .collect();
    assert_eq!(files, declared, "ptx/ files and crate modules differ");
    for module in MODULES {
        let on_disk = std::fs::read_to_string(repo_root().join(module.file)).unwrap();
        assert_eq!(
            on_disk, module.text,
            "{} changed since the crate was built",
            module.file
        );
    }
}

#[test]
fn every_file_targets_sm_80_with_isa_at_most_9_0() {
    for module in MODULES {
        let mut version = None;
        let mut target = None;
        for line in module.text.lines() {
            let line = line.split("//").next().unwrap_or("").trim();
            if let Some(v) = line.strip_prefix(".version") {
                version = Some(v.trim().to_string());
            }
            if let Some(t) = line.strip_prefix(".target") {
                target = Some(t.trim().to_string());
            }
        }
        let version = version.unwrap_or_else(|| panic!("{} has no .version", module.file));
        let (major, minor) = version
            .split_once('.')
            .map(|(a, b)| (a.parse::<u32>().unwrap(), b.parse::<u32>().unwrap()))
            .unwrap_or_else(|| panic!("{}: bad .version {version}", module.file));
        assert!(
            (major, minor) <= (9, 0),
            "{}: .version {version} is above 9.0 (the CUDA 13.0 driver JIT)",
            module.file
        );
        assert_eq!(target.as_deref(), Some("sm_80"), "{}: .target", module.file);
    }
}

#[test]
fn declarations_are_unique_and_kernel_lookup_works() {
    for module in MODULES {
        for (i, k) in module.kernels.iter().enumerate() {
            assert!(
                !module.kernels[..i].iter().any(|o| o.name == k.name),
                "{} declares {} twice",
                module.file,
                k.name
            );
            assert_eq!(module.kernel(k.name).unwrap().params, k.params);
        }
        let err = module.kernel("no_such_kernel").unwrap_err().to_string();
        assert!(err.contains("no_such_kernel"), "{err}");
    }
}

#[test]
fn a_changed_parameter_list_is_detected() {
    // Take a real entry and change one parameter type in the text: verification
    // against the real declarations must fail and name the entry.
    let module = &ringtrain_cuda::optim::MODULE;
    let changed = module.text.replacen(".param .f32 lr", ".param .u32 lr", 1);
    assert_ne!(changed, module.text);
    let entries = parse_ptx_entries(&changed).unwrap();
    let err = ringtrain_cuda::compare_entries(module.kernels, &entries)
        .unwrap_err()
        .to_string();
    assert!(err.contains("`sgd_step`"), "{err}");

    // An entry removed from the text is reported as a declaration without entry.
    let removed = module
        .text
        .replacen(".entry scale_f32(", ".entry renamed_scale(", 1);
    let entries = parse_ptx_entries(&removed).unwrap();
    let err = ringtrain_cuda::compare_entries(module.kernels, &entries)
        .unwrap_err()
        .to_string();
    assert!(err.contains("`scale_f32` has no `.entry`"), "{err}");
    assert!(err.contains("`renamed_scale`"), "{err}");
}

#[test]
fn lstm_entries_follow_the_cpu_argument_order() {
    // Spot-check one declaration against the CPU twin's argument list:
    // (gates, bias, c_prev, c, h, act, batch, hidden).
    let k = ringtrain_cuda::lstm::MODULE
        .kernel("lstm_pointwise_forward")
        .unwrap();
    use Param::*;
    assert_eq!(k.params, &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32]);
    let entries = parse_ptx_entries(ringtrain_cuda::lstm::PTX).unwrap();
    let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "lstm_pointwise_forward",
            "lstm_pointwise_forward_step",
            "lstm_pointwise_backward"
        ]
    );
}
