//! Chat templates rendered as Hugging Face's `apply_chat_template` renders them: Jinja2 with
//! trim_blocks and lstrip_blocks, loop controls, Python's string and dict methods
//! (minijinja-contrib's pycompat), `raise_exception`, `strftime_now`, and a `tojson` that writes
//! what Python's `json.dumps(ensure_ascii=False)` writes. A template is input from a model file:
//! its work is bounded (fuel), its errors come back as text, and a panic never crosses the C
//! interface.
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Instructions a render may take: far beyond any real chat template's few thousand.
const FUEL: u64 = 5_000_000;

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> Result<String, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        Error::new(ErrorKind::InvalidOperation, format!("strftime_now: bad format '{format}'"))
    })?;
    Ok(out)
}

/// Python's repr of a float: the shortest digits that round-trip, positional for exponents in
/// [-4, 16), else d.ddde[+-]XX.
fn python_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let e = format!("{:e}", v); // e.g. "-1.2345e-5", "1e16"
    let (mantissa, exp) = e.split_once('e').unwrap();
    let exp: i32 = exp.parse().unwrap();
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        return format!("{sign}{s}");
    }
    let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
    format!("{sign}{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
}

struct JsonStyle {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// A JSON string as Python's json.dumps writes it; with ensure_ascii, every character past ASCII
/// as \uXXXX (UTF-16, a surrogate pair beyond the BMP).
fn json_string(s: &str, style: &JsonStyle) -> String {
    let quoted = serde_json::to_string(s).unwrap();
    if !style.ensure_ascii || quoted.is_ascii() {
        return quoted;
    }
    let mut out = String::with_capacity(quoted.len() + 16);
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{:04x}", u));
            }
        }
    }
    out
}

fn write_json(v: &Value, style: &JsonStyle, depth: usize, out: &mut String) -> Result<(), Error> {
    if depth > 256 {
        return Err(Error::new(ErrorKind::InvalidOperation, "tojson: nested too deep"));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                out.push_str(&i.to_string());
            } else if let Ok(f) = f64::try_from(v.clone()) {
                out.push_str(&python_float(f));
            } else {
                out.push_str(&v.to_string());
            }
        }
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => write_container(v, style, depth, out)?,
        _ => {
            let s = v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string());
            out.push_str(&json_string(&s, style));
        }
    }
    Ok(())
}

fn write_container(v: &Value, style: &JsonStyle, depth: usize, out: &mut String) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            if items.is_empty() {
                out.push(']');
                return Ok(());
            }
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item);
                }
                newline(out, depth + 1);
                write_json(item, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if style.sort_keys {
                keys.sort_by(|a, b| a.to_string().cmp(&b.to_string()));
            }
            out.push('{');
            if keys.is_empty() {
                out.push('}');
                return Ok(());
            }
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item);
                }
                newline(out, depth + 1);
                let name = k.as_str().map(str::to_owned).unwrap_or_else(|| k.to_string());
                out.push_str(&json_string(&name, style));
                out.push_str(&style.key);
                write_json(&v.get_item(k)?, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {}
    }
    Ok(())
}

/// `tojson` as transformers defines it: json.dumps(x, ensure_ascii=ensure_ascii (default False),
/// indent=indent, separators=separators, sort_keys=sort_keys), Python's default separators
/// (", " and ": ", "," between items when indented).
fn tojson(v: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match indent.or(kwargs.get::<Option<Value>>("indent")?) {
        Some(i) if i.is_none() => None,
        Some(i) => match i.as_i64() {
            Some(n) if (0..=64).contains(&n) => Some(" ".repeat(n as usize)),
            _ => Some(i.as_str().map(str::to_owned).unwrap_or_default()),
        },
        None => None,
    };
    let (mut item, mut key) =
        (if indent.is_some() { ",".to_string() } else { ", ".to_string() }, ": ".to_string());
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        if parts.len() != 2 {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators is a pair"));
        }
        item = parts[0].as_str().unwrap_or(",").to_string();
        key = parts[1].as_str().unwrap_or(":").to_string();
    }
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(v, &JsonStyle { indent, item, key, sort_keys, ensure_ascii }, 0, &mut out)?;
    Ok(out)
}

/// Jinja2's `iterable` test: what Python's iter() takes. None (and a number or a boolean) is not,
/// an undefined value is (Jinja2's Undefined iterates as empty); minijinja would iterate a none.
fn is_iterable(v: &Value) -> bool {
    match v.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
        ValueKind::Undefined | ValueKind::String | ValueKind::Bytes => true,
        _ => v.try_iter().is_ok(),
    }
}

/// transformers' `{% generation %}` ... `{% endgeneration %}` (its AssistantTracker extension,
/// which marks the assistant's tokens for training masks and renders the body as it is, as TRL's
/// templates use it): rewritten as an `if true` block, whitespace control kept.
fn generation_blocks(template: &str) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(close) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..close];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(body) => (&inner[..1], body),
            None => ("", inner),
        };
        let (trail, body) = match body.strip_suffix(['-', '+']) {
            Some(rest) => (&body[rest.len()..], rest),
            None => ("", body),
        };
        let word = body.trim();
        match word {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    out
}

fn render(template: &str, context: &str) -> Result<String, String> {
    // Jinja2 reads a template's line endings as "\n" (its newline_sequence): a file written with
    // CRLF renders as one written with LF.
    let template = generation_blocks(&template.replace("\r\n", "\n").replace('\r', "\n"));
    let template = template.as_str();
    let ctx: serde_json::Value =
        serde_json::from_str(context).map_err(|e| format!("the context is not JSON: {e}"))?;
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?,
    );
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_test("iterable", is_iterable);
    // Python's spelling of True, False and None where a template prints one.
    env.set_formatter(|out, state, value| match value.kind() {
        ValueKind::Bool => out.write_str(if value.is_true() { "True" } else { "False" }).map_err(Error::from),
        ValueKind::None => out.write_str("None").map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    });
    let describe = |e: Error| {
        let mut s = e.to_string();
        if let Some(line) = e.line() {
            if !s.contains("line") {
                s = format!("{s} (line {line})");
            }
        }
        s
    };
    env.add_template("chat_template", template).map_err(describe)?;
    let tmpl = env.get_template("chat_template").map_err(describe)?;
    tmpl.render(Value::from(minijinja::value::Serde(&ctx))).map_err(describe)
}

fn give(s: String, out: *mut *mut u8, out_len: *mut usize) {
    let b = s.into_bytes().into_boxed_slice();
    unsafe {
        *out_len = b.len();
        *out = Box::into_raw(b) as *mut u8;
    }
}

/// Renders `template` with the JSON object `context`. 0: `*out` holds the text; 1: the error
/// message. Either way `*out` (`*out_len` bytes, not terminated) goes back to
/// ss_jinja_free.
#[no_mangle]
pub extern "C" fn ss_jinja_render(
    template: *const u8,
    template_len: usize,
    context: *const u8,
    context_len: usize,
    out: *mut *mut u8,
    out_len: *mut usize,
) -> i32 {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let t = unsafe { std::slice::from_raw_parts(template, template_len) };
        let c = unsafe { std::slice::from_raw_parts(context, context_len) };
        let t = std::str::from_utf8(t).map_err(|_| "the template is not UTF-8".to_string())?;
        let c = std::str::from_utf8(c).map_err(|_| "the context is not UTF-8".to_string())?;
        render(t, c)
    }));
    match result {
        Ok(Ok(text)) => {
            give(text, out, out_len);
            0
        }
        Ok(Err(message)) => {
            give(message, out, out_len);
            1
        }
        Err(_) => {
            give("the template engine failed (a panic in minijinja)".into(), out, out_len);
            1
        }
    }
}

#[no_mangle]
pub extern "C" fn ss_jinja_free(p: *mut u8, len: usize) {
    if !p.is_null() {
        unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len))) };
    }
}
